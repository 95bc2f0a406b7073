"""Issue 34, findings 2, 8 and 10: a heal source cannot hijack a site; heal size capped by the site's own
state; "auto" never falls back to gloo, and gloo is announced as unsafe."""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import timedelta

import pytest
import torch
from torch.distributed import TCPStore

from trainer.codecs.compression import Compressor
from trainer.outer import heal_guard as hg
from trainer.outer.optimizer import OuterState
from trainer.rules.config import cross_site_transport, from_dict
from trainer.rules.tables import ConfigError
from trainer.transport.heal import decode, encode

LIMITS = hg.HealLimits(planned_rounds=10, total_steps=40, h=4, h_auto=False, h_min=1, h_max=4)
SHAPES = [(4, 3), (5,)]


def site_state(seed: int = 0, rounds: int = 2) -> tuple[OuterState, dict]:
    """A real OuterState stepped `rounds` times and the heal state trainer.modes.loop's _ft_state makes of it."""
    gen = torch.Generator().manual_seed(seed)
    cfg = from_dict({"diloco": {"sites": 3, "h": 4, "rounds": 10}}).diloco
    outer = OuterState([torch.randn(s, generator=torch.Generator().manual_seed(1)) for s in SHAPES], cfg)
    for _ in range(rounds):
        outer.step([0.01 * torch.randn(s, generator=gen) for s in SHAPES], 3)
    comp = Compressor(spec="none")
    state = {"outer": outer.state_dict(), "codec": comp.global_state(), "round": rounds, "step": 4 * rounds, "h": 4}
    return outer, state


def wire(state: dict, step: int) -> dict:
    """What torchft hands the healer: the source's manager state, through the real heal encoding."""
    return decode(encode({"user": {"default": state}, "torchft": {"step": step, "batches_committed": 3 * step}}))


def own() -> dict:
    return site_state(seed=0, rounds=2)[1]


def source(rounds: int = 3) -> dict:
    return site_state(seed=0, rounds=rounds)[1]  # the same run one round further


def test_an_honest_source_one_round_ahead_passes():
    assert hg.check_state(wire(source(), 3), 3, own(), LIMITS, live=True) is None
    assert hg.check_claim(hg.QuorumView(own_step=2, max_step=3, participants=3, at_max=2, source="b"), live=True) is None


@pytest.mark.parametrize("poison, needle", [
    (lambda s: s["outer"]["params"][0].fill_(1e30), "θ is 1.32e+30 x ||θ|| from this site's own (at most 0.5)"),
    (lambda s: s["outer"]["params"][1].__setitem__(2, float("nan")), "outer.params[1] holds non-finite values"),
    (lambda s: s["outer"]["params"].__setitem__(0, torch.zeros(3, 4)), "outer.params[0] is torch.float32 (3, 4), "
                                                                       "this site's is torch.float32 (4, 3)"),
    (lambda s: s["outer"]["params"].__setitem__(1, torch.zeros(5, dtype=torch.float64)), "is torch.float64 (5,)"),
    (lambda s: s["outer"]["params"].pop(), "outer.params: 1 tensors, this site has 2"),
    (lambda s: s["outer"]["opt"]["state"][0]["momentum_buffer"].fill_(1e6), "outer momentum is"),
    (lambda s: s["outer"]["opt"]["state"].__setitem__(7, {"momentum_buffer": torch.zeros(1)}), "entry 7 names no"),
    (lambda s: s.__setitem__("round", 10**9), "round 1000000000 is beyond the run's 10 rounds"),
    (lambda s: s.__setitem__("round", 7), "round 7, but this site completed round 2 with the quorum"),
    (lambda s: s.__setitem__("step", 10**9), "inner step 1000000000 is beyond the run's 40 steps"),
    (lambda s: s.__setitem__("h", 1000), "H 1000 is not one this run can use"),
    (lambda s: s.__setitem__("codec", {"spec": "int8", "q": {}}), "not for this site's codec 'none'"),
    (lambda s: s.__setitem__("extra", 1), "state keys"),
])
def test_a_poisoned_heal_state_is_refused(poison, needle):
    got = wire(source(), 3)
    poison(got["user"]["default"])
    assert needle in (hg.check_state(got, 3, own(), LIMITS, live=True) or "")


def test_a_live_site_accepts_a_round_one_either_side_of_its_own():
    for r in (1, 2, 3):
        got = wire(source(), 3)
        got["user"]["default"]["round"] = r
        assert hg.check_state(got, 3, own(), LIMITS, live=True) is None, r


def test_theta_far_from_a_live_sites_own_is_refused_at_a_tighter_bound():
    got = wire(source(), 3)
    for p in got["user"]["default"]["outer"]["params"]:
        p.mul_(2.0)  # distance 1 x ||θ||: possible after a restart, not one round after a commit
    assert hg.check_state(got, 3, own(), LIMITS, live=False) is None
    assert "(at most 0.5)" in hg.check_state(got, 3, own(), LIMITS, live=True)


def test_the_torchft_step_must_be_the_claimed_one():
    assert "does not match the claimed step 3" in hg.check_state(wire(source(), 10**9), 3, own(), LIMITS, live=False)


def test_a_claimed_step_a_live_site_knows_to_be_impossible_is_refused():
    liar = hg.QuorumView(own_step=5, max_step=10**9, participants=3, at_max=1, source="c")
    assert "claims step 1000000000, but this site committed step 5" in hg.check_claim(liar, live=True)
    # one ahead is possible, but not when the other honest site does not report it
    minority = replace(liar, max_step=6)
    assert "only 1 of the quorum's 2 other sites report" in hg.check_claim(minority, live=True)
    assert hg.check_claim(replace(minority, participants=2), live=True) is None  # 2 sites: no majority to ask
    assert hg.check_claim(liar, live=False) is None  # a restarted site cannot know; its state is still screened


def test_a_straggler_the_majority_went_on_without_heals_however_far_behind():
    # a site slowed 6x fell 2 commits behind a quorum of 3 that went on without it; refused, it never rejoined
    straggler = hg.QuorumView(own_step=1, max_step=3, participants=3, at_max=2, source="a")
    assert hg.corroborated(straggler) and hg.check_claim(straggler, live=True) is None
    # a claim only the source makes, or a quorum of 2 (nobody to ask), keeps the one-commit bound
    assert "at most 1 ahead" in hg.check_claim(replace(straggler, at_max=1), live=True)
    assert "at most 1 ahead" in hg.check_claim(replace(straggler, participants=2, at_max=1), live=True)
    assert not hg.corroborated(replace(straggler, participants=2, at_max=2))


def test_a_reachable_step_nobody_vouched_for_is_refused_once_not_for_good():
    """A straggler in a quorum of 3 whose source, 2 commits ahead, no other site vouches for: refused, but
    the same source, vouched for by a majority in a later quorum, is healed from (refused for good, the
    straggler of a 3-site run with min_sites 2 never rejoined)."""
    state = own()
    guard = hg.HealGuard(own_state=lambda: state, limits=LIMITS)
    guard.note_quorum(4, _Quorum(3))
    guard.note_commit(3, committed=True)  # live at step 4
    guard.note_quorum(4, _Quorum(6, src=0, world=3, at_max=1))  # a, 2 ahead, only it reports step 6
    with pytest.raises(hg.HealRefused, match="at most 1 ahead"):
        guard.screen(wire(source(), 6), 6)
    assert guard.refused == {}
    guard.note_quorum(4, _Quorum(6, src=0, world=3, at_max=2))  # a and b report step 6
    guard.screen(wire(source(), 6), 6)


def test_a_straggler_in_a_quorum_of_two_heals_however_far_behind_at_the_live_bound():
    """Nobody to ask in a quorum of two: refusing forked θ for good (2 sites, one paused 3 rounds, refused
    its peer in every later round). A reachable step is healed from, held to a live site's distance bound;
    a step past the run's plan is still refused for good."""
    state = own()
    guard = hg.HealGuard(own_state=lambda: state, limits=LIMITS)
    guard.note_quorum(4, _Quorum(3))
    guard.note_commit(3, committed=True)  # live at step 4
    guard.note_quorum(4, _Quorum(8, src=0, world=2, at_max=1))  # a, 4 commits ahead
    far = source(rounds=6)  # 4 rounds on: the live round check (one either side) would refuse it
    guard.screen(wire(far, 8), 8)
    assert guard.refused == {}
    moved = wire(source(rounds=6), 8)
    for p in moved["user"]["default"]["outer"]["params"]:
        p.mul_(2.0)  # 1 x ||θ|| away: a restarted site would take it, a live straggler does not
    with pytest.raises(hg.HealRefused, match=r"\(at most 0.5\)"):
        guard.screen(moved, 8)
    assert list(guard.refused) == ["a"]
    liar = hg.HealGuard(own_state=lambda: state, limits=LIMITS)
    liar.note_quorum(4, _Quorum(3))
    liar.note_commit(3, committed=True)
    liar.note_quorum(4, _Quorum(11, src=0, world=2, at_max=1))  # past the run's 10 commits
    with pytest.raises(hg.HealRefused, match="at most 1 ahead"):
        liar.screen(wire(source(), 11), 11)
    assert list(liar.refused) == ["a"]


class _Quorum:  # torchft's QuorumResult, as far as the guard reads it
    def __init__(self, max_step, src=2, world=3, at_max=1):
        self.max_step, self.recover_src_replica_rank, self.replica_world_size = max_step, src, world
        self.max_world_size, self.replica_ids = at_max, ["a:u1", "b:u2", "c:u3"]


def test_the_guard_knows_a_live_site_from_its_commit_votes_and_excludes_a_refused_source():
    state = own()
    guard = hg.HealGuard(own_state=lambda: state, limits=LIMITS)
    guard.note_quorum(4, _Quorum(3))
    guard.note_commit(4, True)  # committed step 4: the manager is at 5
    guard.note_quorum(5, _Quorum(10**9))
    assert guard.live()
    with pytest.raises(hg.HealRefused, match=r"heal from c refused: claims step 1000000000, but this site committed"):
        guard.screen(wire(source(), 10**9), 10**9)
    assert list(guard.refused) == ["c"]
    guard.note_commit(5, False)  # a failed vote: not live any more, yet c stays refused whatever it sends
    guard.note_quorum(5, _Quorum(6, at_max=2))
    assert not guard.live()
    with pytest.raises(hg.HealRefused, match=r"heal from c refused: refused before \(claims step 1000000000"):
        guard.screen(wire(source(), 6), 6)
    guard.note_quorum(5, _Quorum(6, src=1, at_max=2))  # an honest source, b
    guard.screen(wire(source(), 6), 6)


def test_optimizer_settings_from_a_peer_are_ignored_only_its_state_is_taken():
    mine, _ = site_state(rounds=0)
    peer, sd = site_state(seed=3, rounds=2)
    group = sd["outer"]["opt"]["param_groups"][0]
    group.update(lr=100.0, momentum=0.0, nesterov=False, weight_decay=5.0, dampening=0.5, maximize=True)
    mine.load_state_dict(decode(encode(sd["outer"])))
    g = mine.opt.param_groups[0]
    assert (g["lr"], g["momentum"], g["nesterov"], g["weight_decay"], g["dampening"], g["maximize"]) == \
        (mine.lr, mine.momentum, True, 0, 0, False)
    torch.testing.assert_close(mine.opt.state[mine.params[0]]["momentum_buffer"],
                               peer.opt.state[peer.params[0]]["momentum_buffer"])
    step = [torch.ones(s) for s in SHAPES]  # then both step alike: the same θ
    mine.step(step, 3)
    peer.step(step, 3)
    torch.testing.assert_close(mine.params, peer.params)


def test_the_heal_cap_is_the_sites_own_state_size():
    fresh = site_state(rounds=0)[1]  # no momentum buffers yet: a source will send one per parameter
    stepped = source()
    tensor_bytes = sum(4 * torch.Size(s).numel() for s in SHAPES)
    assert hg.expected_heal_bytes(fresh) == hg.expected_heal_bytes(stepped)
    assert hg.expected_heal_bytes(stepped) == 2 * tensor_bytes + hg.HEAL_MARGIN_BYTES + hg.HEAL_BYTES_PER_TENSOR * 4
    assert len(encode({"step": 3, "state": {"user": {"default": stepped}, "torchft": {"step": 3,
               "batches_committed": 9}}})) <= hg.expected_heal_bytes(fresh)


@pytest.fixture(scope="module")
def ids(tmp_path_factory):
    from dilococtl import run_ca

    return run_ca.ensure(tmp_path_factory.mktemp("ca"), "run-heal", ["paris", "tokyo"])


def test_a_heal_announced_above_the_sites_own_state_size_is_refused_before_allocation(ids):
    import threading

    from trainer.transport import Identity, TransportError
    from trainer.transport.heal import checkpoint_transport
    from trainer.transport.pg import ProcessGroupTls
    from trainer.transport.wire import OP_BLOB, pack_header

    t = timedelta(seconds=20)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=t)
    pgs = [ProcessGroupTls(Identity(site=s, cert=str(ids[s].cert), key=str(ids[s].key), ca=str(ids[s].ca)),
                           timeout=t, streams=1, bind="127.0.0.1", host="127.0.0.1") for s in ("paris", "tokyo")]
    try:
        ths = [threading.Thread(target=pgs[r].configure, args=(f"127.0.0.1:{store.port}/cap/1", "x", r, 2),
                                kwargs={"quorum_id": 1}) for r in range(2)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(30)
        state = own()
        guard = hg.HealGuard(own_state=lambda: state, limits=LIMITS)
        healer = checkpoint_transport(pgs[1], max_bytes=guard.cap)
        # the source announces 1 TiB (a header alone: nothing else is sent)
        pgs[0].live().mesh.tx(1, 0).sendall(pack_header(OP_BLOB, torch.uint8, 0, 0, 0, 0, 1 << 40, 1 << 40))
        with pytest.raises(TransportError, match=f"1099511627776 bytes of heal state, more than the "
                                                 f"{hg.expected_heal_bytes(state)} allowed"):
            healer.recv_checkpoint(0, "dilococtl-tls", 3, t)
        with pytest.raises(TransportError, match="no size cap"):  # a transport made without a cap only sends
            checkpoint_transport(pgs[1]).recv_checkpoint(0, "dilococtl-tls", 3, t)
    finally:
        for pg in pgs:
            pg.shutdown()


def test_auto_without_an_identity_is_an_error_naming_what_is_missing():
    with pytest.raises(ConfigError) as e:
        cross_site_transport(from_dict({"run": {"tls_ca": "/k/ca.crt"}}))
    msg = str(e.value)
    assert "no run.tls_cert, run.tls_key" in msg and "tls_ca" not in msg.split("no ")[1].split("(")[0]
    assert 'set transport = "gloo" explicitly' in msg and "\n" not in msg
    assert cross_site_transport(from_dict({"diloco": {"transport": "gloo"}})) == "gloo"
    ident = {"tls_ca": "ca", "tls_cert": "c", "tls_key": "k"}
    assert cross_site_transport(from_dict({"run": ident})) == "tls"


def test_gloo_is_announced_unsafe_at_start_and_its_heals_are_screened_too(monkeypatch, caplog):
    from torchft.coordination import LighthouseServer

    from trainer.modes.ft import GLOO_WARNING, make_manager, transport_note

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}.items():
        monkeypatch.setenv(k, v)
    cfg = from_dict({"diloco": {"transport": "gloo"}, "run": {"lighthouse": lighthouse.address(), "site": "paris"}})
    assert "WARNING: plaintext, heal state unpickled" in transport_note(cfg)
    state = own()
    with caplog.at_level(logging.WARNING, logger="trainer.modes.ft"):
        manager = make_manager(cfg, timedelta(seconds=10), lambda: state, lambda sd: None)
    try:
        assert GLOO_WARNING in caplog.text and "weights_only=False" in GLOO_WARNING
        assert manager._checkpoint_transport.guard is manager._dilococtl_heal  # HTTP heals screened as well
        assert type(manager._checkpoint_transport.inner).__name__ == "HTTPTransport"
    finally:
        manager.shutdown(wait=False)
        lighthouse.shutdown()


def fragmented(state: dict, fragment: int = 1, h_done: int = 2) -> dict:
    """A heal state of a run with 3 fragments (trainer.modes.loop._ft_state): the others' codec states and its place."""
    comp = Compressor(spec="none")
    return {**state, "codecs": [comp.global_state(), comp.global_state()], "fragment": fragment, "h_done": h_done}


@pytest.mark.parametrize("poison, needle", [
    (lambda s: s.__setitem__("codecs", s["codecs"][:1]), "1 fragment codec states, this site has 2"),
    (lambda s: s.__setitem__("codecs", "x"), "str fragment codec states"),
    (lambda s: s["codecs"].__setitem__(1, {"spec": "int8", "q": {}}), "not for this site's codec 'none'"),
    (lambda s: s.__setitem__("fragment", 7), "fragment 7 after inner step 2 is not a place in a round of 4"),
    (lambda s: s.__setitem__("fragment", True), "fragment True after"),
    (lambda s: s.__setitem__("h_done", 5), "fragment 1 after inner step 5 is not a place"),
    (lambda s: s.__setitem__("h_done", -1), "after inner step -1 is not a place"),
])
def test_a_fragmented_heal_state_is_screened(poison, needle):
    assert hg.check_state(wire(fragmented(source()), 3), 3, fragmented(own()), LIMITS, live=True) is None
    got = wire(fragmented(source()), 3)
    poison(got["user"]["default"])
    assert needle in (hg.check_state(got, 3, fragmented(own()), LIMITS, live=True) or "")


def test_with_fragments_a_run_makes_a_commit_per_fragment_exchange():
    limits = hg.HealLimits.from_config(from_dict({"diloco": {"h": 4, "rounds": 10, "fragments": 3}}))
    assert (limits.planned_rounds, limits.commits) == (10, 30)
    # a straggler's source 25 commits in (round 9 of 10), which no other site of the quorum reports, is
    # reachable: refused this once, not for good
    state = own()
    guard = hg.HealGuard(own_state=lambda: state, limits=limits)
    guard.note_quorum(4, _Quorum(3))
    guard.note_commit(3, committed=True)
    guard.note_quorum(4, _Quorum(25, src=0, world=3, at_max=1))
    with pytest.raises(hg.HealRefused, match="at most 1 ahead"):
        guard.screen(wire(source(), 25), 25)
    assert guard.refused == {}


def test_a_live_site_one_commit_behind_heals_from_a_source_a_round_further_on():
    """A live site the quorum went on without once (3-site chaos run, a 250 ms join window) was 2 rounds
    behind its source, 1 commit ahead of it: refused for good under the one-either-side rule, it trained on
    its own θ for the rest of the run. A round per commit ahead is allowed, and no more."""
    state = own()  # completed round 2
    guard = hg.HealGuard(own_state=lambda: state, limits=LIMITS)
    guard.note_quorum(4, _Quorum(3))
    guard.note_commit(3, committed=True)  # live at step 4
    guard.note_quorum(4, _Quorum(5, src=0, world=2, at_max=1))  # a, 1 commit ahead, in a quorum of two
    ahead = wire(source(), 5)
    ahead["user"]["default"]["round"] = 4
    guard.screen(ahead, 5)
    ahead["user"]["default"]["round"] = 5  # 3 rounds for 1 commit: not an honest source
    with pytest.raises(hg.HealRefused, match="round 5, but this site completed round 2"):
        guard.screen(ahead, 5)


def test_under_the_time_policy_a_site_may_pass_rounds_x_h_inner_steps():
    """h_policy "time": a fast site takes up to MAX_TIME_STEPS x H steps a round; its 25,010 steps of a
    run of 48 x 500 were refused for good as "beyond the run's 24000 steps" and the run ended forked."""
    steps = hg.HealLimits.from_config(from_dict({"diloco": {"h": 4, "rounds": 10}})).total_steps
    timed = hg.HealLimits.from_config(from_dict({"diloco": {"h": 4, "rounds": 10, "h_policy": "time"}}))
    assert (steps, timed.total_steps) == (40, 160)
    got = wire(source(), 3)
    got["user"]["default"]["step"] = 41
    assert "inner step 41 is beyond the run's 40 steps" in hg.check_state(got, 3, own(), LIMITS, live=False)
    assert hg.check_state(got, 3, own(), timed, live=False) is None
    got["user"]["default"]["step"] = 161
    assert "beyond the run's 160 steps" in hg.check_state(got, 3, own(), timed, live=False)
