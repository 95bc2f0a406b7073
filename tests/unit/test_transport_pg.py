"""ProcessGroupTls as torchft configures it (a store per quorum), and heal state over it."""

import os
import pickle
import threading
from datetime import timedelta

import pytest
import torch
from torch.distributed import ReduceOp, TCPStore
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, AllToAllOptions

from dilococtl import run_ca
from tests.ports import free_port
from trainer.transport import Identity, TransportError
from trainer.transport.heal import HealFormatError, checkpoint_transport, decode, encode
from trainer.transport.pg import ProcessGroupTls

T = timedelta(seconds=20)


@pytest.fixture(scope="module")
def ids(tmp_path_factory):
    return run_ca.ensure(tmp_path_factory.mktemp("ca"), "run-pg", ["paris", "tokyo"])


@pytest.fixture
def store():
    s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T)
    yield s


def make_pgs(ids, streams=2):
    return [ProcessGroupTls(Identity(site=s, cert=str(ids[s].cert), key=str(ids[s].key), ca=str(ids[s].ca)),
                            timeout=T, streams=streams, bind="127.0.0.1", host="127.0.0.1")
            for s in ("paris", "tokyo")]


def both(fn):
    out, errs = [None, None], [None, None]

    def body(r):
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: BLE001
            errs[r] = e

    ths = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(60)
    for e in errs:
        if e is not None:
            raise e
    return out


def sum_opts():
    o = AllreduceOptions()
    o.reduceOp = ReduceOp.SUM
    return o


def test_configure_per_quorum_then_collectives_through_the_torchft_interface(ids, store):
    pgs = make_pgs(ids)
    port = store.port
    try:
        def quorum(r, q):
            pg = pgs[r]
            pg.configure(f"127.0.0.1:{port}/torchft/{q}/0", pg.identity.site, r, 2, quorum_id=q)
            t = torch.full((1000,), float(r + 1))
            pg.allreduce([t], sum_opts()).wait(T)
            outs = [torch.empty(3, dtype=torch.float64) for _ in range(2)]
            pg.allgather([outs], [torch.full((3,), float(r), dtype=torch.float64)], AllgatherOptions()).wait(T)
            a2 = torch.empty(4)
            pg.alltoall_base(a2, torch.arange(4.0) + 10 * r, [], [], AllToAllOptions()).wait()
            return pg.rank(), pg.size(), t[0].item(), [o[0].item() for o in outs], a2.tolist()

        first = both(lambda r: quorum(r, 1))
        assert first[0] == (0, 2, 3.0, [0.0, 1.0], [0.0, 1.0, 10.0, 11.0])
        assert first[1] == (1, 2, 3.0, [0.0, 1.0], [2.0, 3.0, 12.0, 13.0])
        threads, fds = threading.active_count(), len(os.listdir("/proc/self/fd"))
        for q in (2, 3, 4):  # new quorums: new meshes, nothing left from the old ones
            assert both(lambda r, q=q: quorum(r, q)) == first
        assert threading.active_count() == threads
        assert len(os.listdir("/proc/self/fd")) == fds
    finally:
        for pg in pgs:
            pg.shutdown()


def test_a_failed_collective_is_reported_by_errored_until_the_next_quorum(ids, store):
    pgs = make_pgs(ids)
    for pg in pgs:
        pg.set_timeout(timedelta(seconds=1))
    try:
        both(lambda r: pgs[r].configure(f"127.0.0.1:{store.port}/q/1", "x", r, 2, quorum_id=1))
        with pytest.raises(TransportError):
            pgs[0].allreduce([torch.ones(3)], sum_opts())  # rank 1 never joins this one
        assert isinstance(pgs[0].errored(), TransportError)
        pgs[1].abort()
        both(lambda r: pgs[r].configure(f"127.0.0.1:{store.port}/q/2", "x", r, 2, quorum_id=2))
        assert pgs[0].errored() is None
    finally:
        for pg in pgs:
            pg.shutdown()


def test_heal_state_crosses_as_tensors_and_plain_values(ids, store):
    pgs = make_pgs(ids)
    try:
        both(lambda r: pgs[r].configure(f"127.0.0.1:{store.port}/h/1", "x", r, 2, quorum_id=1))
        state = {"user": {"outer": {"params": [torch.randn(3, 4), torch.arange(5)],
                                    "opt": {"state": {0: {"momentum_buffer": torch.ones(2, dtype=torch.bfloat16)}},
                                            "param_groups": [{"lr": 0.7, "nesterov": True, "foreach": None,
                                                              "betas": (0.9, 0.95), "params": [0, 1]}]}},
                          "round": 7, "name": "paris"},
                 "torchft": {"step": 7, "batches_committed": 14}}
        transports = [checkpoint_transport(pg, max_bytes=1 << 20) for pg in pgs]

        def run(r):
            if r == 0:
                return transports[0].send_checkpoint([1], 7, state, T)
            return transports[1].recv_checkpoint(0, transports[0].metadata(), 7, T)

        got = both(run)[1]
        torch.testing.assert_close(got["user"]["outer"]["params"], state["user"]["outer"]["params"])
        assert got["user"]["outer"]["opt"]["state"][0]["momentum_buffer"].dtype == torch.bfloat16
        assert got["user"]["outer"]["opt"]["param_groups"] == state["user"]["outer"]["opt"]["param_groups"]
        assert got["torchft"] == {"step": 7, "batches_committed": 14} and got["user"]["name"] == "paris"
    finally:
        for pg in pgs:
            pg.shutdown()


class Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/dilococtl-pwned",))


def test_heal_state_is_never_unpickled():
    evil = pickle.dumps({"user": Boom()})
    with pytest.raises(HealFormatError):
        decode(evil)
    assert not os.path.exists("/tmp/dilococtl-pwned")
    with pytest.raises(HealFormatError, match="only tensors"):
        encode({"x": Boom()})
    # a well-formed safetensors file whose tree names a tensor it does not hold
    from safetensors.torch import save

    with pytest.raises(HealFormatError, match="malformed"):
        decode(save({"t0": torch.ones(1)}, metadata={"dilococtl-tree": '{"T": "t9"}'}))
    assert decode(encode({"a": [1, 2.5, None, "s", (True,)]})) == {"a": [1, 2.5, None, "s", (True,)]}


def test_a_healer_refuses_state_larger_than_it_allows(ids, store):
    pgs = make_pgs(ids)
    try:
        both(lambda r: pgs[r].configure(f"127.0.0.1:{store.port}/big/1", "x", r, 2, quorum_id=1))
        small = checkpoint_transport(pgs[1], max_bytes=1000)

        def run(r):
            if r == 0:
                try:
                    checkpoint_transport(pgs[0]).send_checkpoint([1], 1, {"w": torch.zeros(10_000)}, T)
                except TransportError:
                    pass  # the healer hung up
                return None
            with pytest.raises(TransportError, match="more than the 1000 allowed"):
                small.recv_checkpoint(0, "dilococtl-tls", 1, T)
            return True

        assert both(run)[1] is True
    finally:
        for pg in pgs:
            pg.shutdown()


def test_heal_before_any_quorum_fails_with_a_transport_error(ids):
    pg = make_pgs(ids)[0]
    try:
        with pytest.raises(TransportError, match="not configured"):
            checkpoint_transport(pg).recv_checkpoint(1, "dilococtl-tls", 1, T)
    finally:
        pg.shutdown()


@pytest.mark.parametrize("over, key", [
    ({"diloco.transport_streams": 0}, "diloco.transport_streams"),
    ({"diloco.transport_streams": 257}, "diloco.transport_streams"),
    ({"diloco.transport_pace_mbit": float("nan")}, "diloco.transport_pace_mbit"),
    ({"diloco.transport_pace_mbit": -1.0}, "diloco.transport_pace_mbit"),
    ({"run.transport_port": 70000}, "run.transport_port"),
    ({"diloco.transport_link_pace_mbit": {"a->b": float("inf")}}, "diloco.transport_link_pace_mbit"),
    ({"diloco.transport_link_pace_mbit": {"a->b": -5.0}}, "diloco.transport_link_pace_mbit"),
    ({"diloco.transport_link_pace_mbit": {"a->b": "fast"}}, "diloco.transport_link_pace_mbit"),
    ({"diloco.transport_link_pace_mbit": {"a-b": 5.0}}, "diloco.transport_link_pace_mbit"),
    ({"diloco.transport_link_pace_mbit": {"a->a": 5.0}}, "diloco.transport_link_pace_mbit"),
    ({"diloco.transport_link_pace_mbit": {"a/..->b": 5.0}}, "diloco.transport_link_pace_mbit"),
    ({"diloco.transport_link_pace_mbit": {"a->b\nc": 5.0}}, "diloco.transport_link_pace_mbit"),
    ({"diloco.transport_link_pace_mbit": {"x" * 300 + "->b": 5.0}}, "diloco.transport_link_pace_mbit"),
    ({"diloco.transport_link_pace_mbit": {"a->b->c": 5.0}}, "diloco.transport_link_pace_mbit"),
    ({"diloco.transport_congestion": "Cubic; rm"}, "diloco.transport_congestion"),
])
def test_bad_transport_knobs_are_refused_naming_the_key(over, key):
    from trainer.rules.config import from_dict, validate
    from trainer.rules.tables import ConfigError

    data: dict = {}
    for k, v in over.items():
        section, name = k.split(".")
        data.setdefault(section, {})[name] = v
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(from_dict(data))


def test_a_trainer_config_for_tls_without_its_identity_is_refused(tmp_path):
    from trainer.rules.config import load
    from trainer.rules.tables import ConfigError

    path = tmp_path / "c.toml"
    path.write_text('[diloco]\ntransport = "tls"\n[run]\ntls_ca = "ca.crt"\n')
    with pytest.raises(ConfigError, match="'tls' needs run.tls_ca, run.tls_cert and run.tls_key"):
        load(path)


def test_each_local_rank_listens_on_its_own_port(ids, monkeypatch):

    from trainer.modes.ft import tls_process_group
    from trainer.rules.config import from_dict

    base = free_port()
    i = ids["paris"]
    cfg = from_dict({"diloco": {"transport": "tls", "transport_streams": 3},
                     "run": {"site": "paris", "tls_ca": str(i.ca), "tls_cert": str(i.cert), "tls_key": str(i.key),
                             "transport_port": base, "transport_host": "127.0.0.1"}})
    pgs = []
    try:
        for local in ("0", "1"):
            monkeypatch.setenv("LOCAL_RANK", local)
            pgs.append(tls_process_group(cfg, T))
        assert [pg.listener.port for pg in pgs] == [base, base + 1]
        assert pgs[0].streams == 3 and pgs[0].identity.site == "paris" and pgs[0].host == "127.0.0.1"
    finally:
        for pg in pgs:
            pg.shutdown()


def test_each_peer_is_paced_at_its_own_links_rate(ids, store):
    """diloco.transport_link_pace_mbit: paris's streams to tokyo at their link's pace, tokyo's back at
    the run's transport_pace_mbit (the table names no tokyo->paris link)."""
    import socket

    from trainer.modes.ft import link_paces_from, transport_note
    from trainer.rules.config import from_dict

    d = from_dict({"diloco": {"transport_pace_mbit": 48, "transport_link_pace_mbit": {"paris->tokyo": 16}}}).diloco
    assert link_paces_from(d, "paris") == {"tokyo": 16.0} and link_paces_from(d, "tokyo") == {}
    cfg = from_dict({"diloco": {"transport": "tls", "transport_pace_mbit": 48,
                                "transport_link_pace_mbit": {"paris->tokyo": 16}}, "run": {"site": "paris"}})
    assert transport_note(cfg).endswith("paced to tokyo 16 Mbit/s, other sites 48 Mbit/s")
    # issue 42: one pace for every link, or none, reads as English ("paced to every site unpaced" before)
    assert transport_note(from_dict({"diloco": {"transport": "tls"}})).endswith("direction; unpaced")
    assert transport_note(from_dict({"diloco": {"transport": "tls", "transport_pace_mbit": 48}})).endswith(
        "direction; paced to 48 Mbit/s to every site")
    pgs = [ProcessGroupTls(Identity(site=s, cert=str(ids[s].cert), key=str(ids[s].key), ca=str(ids[s].ca)),
                           timeout=T, streams=2, bind="127.0.0.1", host="127.0.0.1",
                           pace_mbit=d.transport_pace_mbit, link_pace=link_paces_from(d, s))
           for s in ("paris", "tokyo")]
    try:
        def site(r):
            pg = pgs[r]
            pg.configure(f"127.0.0.1:{store.port}/p/1", pg.identity.site, r, 2, quorum_id=1)
            mesh = pg.live().mesh
            return {mesh.tx(1 - r, s).getsockopt(socket.SOL_SOCKET, 47) for s in range(2)}

        paris, tokyo = both(site)
        assert paris == {16_000_000 // 8 // 2} and tokyo == {48_000_000 // 8 // 2}  # bytes/s per stream
    finally:
        for pg in pgs:
            pg.shutdown()
