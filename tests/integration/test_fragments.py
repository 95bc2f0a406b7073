"""diloco.fragments on two torchrun sites through torchft: every fragment's exchange, equal to the simulator."""

from __future__ import annotations

import pytest
import torch

from tests.integration.dist_helpers import start_site, tiny_config
from tests.integration.test_trainer_dist import (  # noqa: F401 (fixtures)
    final_params,
    kill_after_two_rounds,
    lighthouse,
    lighthouse2,
    records,
    wait_all,
)
from trainer.rules.codec_spec import payload_bytes
from trainer.rules.fragments import split
from trainer.simulate import simulate

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_two_sites_with_two_fragments_equal_the_simulator(tmp_path, lighthouse2, mode):  # noqa: F811
    knobs = {"diloco.min_sites": 2, "diloco.compression": "int8", "diloco.fragments": 2, "diloco.h": 4,
             "diloco.mode": mode}
    cfgs = [tiny_config(tmp_path, i, **knobs) for i in range(2)]
    procs = [start_site(c, lighthouse2, tmp_path / f"site{i}.log") for i, c in enumerate(cfgs)]
    codes = wait_all(procs, 240)
    assert codes == [0, 0], [(tmp_path / f"site{i}.log").read_text()[-3000:] for i in range(2)]

    sim = simulate(cfgs[0])
    shapes = [tuple(p.shape) for p in sim.params]
    per = [payload_bytes("int8", [shapes[i] for i in idx], cfgs[0].diloco.codec_options())
           for idx in split([p.numel() for p in sim.params], 2)]
    site0, site1 = final_params(tmp_path, "site0"), final_params(tmp_path, "site1")
    for a, b, s in zip(site0, site1, sim.params, strict=True):
        assert torch.equal(a, b)  # both sites end on the same θ, bit for bit
        torch.testing.assert_close(a, s, rtol=1e-5, atol=1e-7)
    for site in ("site0", "site1"):
        rounds = records(tmp_path, site, "round")
        assert [r.round for r in rounds] == [1, 2, 3]
        assert all(r.k_active == 2 and r.committed for r in rounds)
        if mode == "sync":
            assert [r.bytes_sent for r in rounds] == [r.bytes_sent for r in sim.rounds]
            assert all(r.bytes_sent == sum(per) for r in rounds)  # two exchanges a round, one per fragment
        else:  # a round records the exchanges that landed in it: the first's fragment 0, then 1 and 0, ...
            assert [r.exchange_bytes for r in rounds] == [[per[0]], [per[1], per[0]], [per[1], per[0], per[1]]]
            assert sum(r.bytes_sent for r in rounds) == sum(r.bytes_sent for r in sim.rounds) == 3 * sum(per)
            assert all(r.staleness == 1 for r in rounds)
        assert rounds[-1].val_ppl == pytest.approx(sim.rounds[-1].val_ppl, rel=1e-4)
        assert all(r.quorum_s > 0 and r.payload_s > 0 for r in rounds)
        start = next(e for e in records(tmp_path, site, "event") if e.event == "start")
        assert start.detail["fragment_payload_bytes"] == per and start.detail["payload_bytes"] == sum(per)
    assert max(per) < 0.6 * sum(per)  # the peak of an exchange: one fragment's
    assert all(r.peak_bytes == max(per) for r in sim.rounds)


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_a_killed_site_comes_back_and_heals_to_its_peers_place_in_the_round(tmp_path, lighthouse, mode):  # noqa: F811
    """Fragments 2 of a round of 5 (exchanges after steps 2 and 5): site1 is killed, restarts from its
    checkpoint (each fragment's codec state in it), heals from site0 mid-run and both end on one θ."""
    rounds, h = 150, 5
    cfgs = [tiny_config(tmp_path, i, **{"diloco.rounds": rounds, "diloco.h": h, "diloco.fragments": 2,
                                        "diloco.compression": "int8", "data.batch_size": 16, "data.seq_len": 64,
                                        "diloco.mode": mode})
            for i in range(2)]
    a = start_site(cfgs[0], lighthouse, tmp_path / "a.log")
    b = start_site(cfgs[1], lighthouse, tmp_path / "b.log")
    kill_after_two_rounds(tmp_path, a, b)
    b2 = start_site(cfgs[1], lighthouse, tmp_path / "b2.log")
    codes = wait_all([a, b2], 240)
    assert codes == [0, 0], [(tmp_path / n).read_text()[-3000:] for n in ("a.log", "b2.log")]
    events = records(tmp_path, "site1", "event")
    assert [e for e in events if e.event == "start"][-1].detail["resumed_from"] is not None
    assert any(e.event == "heal" for e in events), [e.event for e in events]
    for x, y in zip(final_params(tmp_path, "site0"), final_params(tmp_path, "site1"), strict=True):
        assert torch.equal(x, y)
    r1 = records(tmp_path, "site1", "round")
    # back in the quorum: on a loaded host a fragment's exchange may still commit without a late site
    # now and then (seen once in CI-like load), so not every one of the last rounds is asked for
    assert r1[-1].round == rounds and sum(r.k_active == 2 and r.committed for r in r1[-10:]) >= 5
    assert [s.step for s in records(tmp_path, "site1", "step")][-1] == rounds * h
    nums = [r.round for r in r1]
    assert nums == sorted(set(nums))
