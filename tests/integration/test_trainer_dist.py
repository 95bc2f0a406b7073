"""Two sites as two torchrun jobs on loopback, through torchft: equal to the simulator; survive a kill."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import torch

from tests.integration.dist_helpers import start_site, tiny_config
from trainer.records import parse_line
from trainer.rules.codec_spec import payload_bytes
from trainer.simulate import simulate

pytestmark = pytest.mark.slow


def _lighthouse(min_replicas: int):
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas, join_timeout_ms=1000)


@pytest.fixture
def lighthouse():
    lh = _lighthouse(1)
    yield lh.address()
    lh.shutdown()


@pytest.fixture
def lighthouse2():
    """A Lighthouse that forms no quorum before both sites are there, as the simulator assumes."""
    lh = _lighthouse(2)
    yield lh.address()
    lh.shutdown()


def records(run_dir: Path, site: str, kind: str) -> list:
    path = run_dir / site / "metrics.jsonl"
    out = [parse_line(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in out if r is not None and r.kind == kind]


def wait_all(procs, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
    return codes


def kill_after_two_rounds(tmp_path: Path, a, b) -> None:
    """Let both sites finish two rounds together, kill site1's process group hard, and wait until
    site0 commits a round alone (K_active = 1)."""
    import os

    deadline = time.monotonic() + 120
    while len(records(tmp_path, "site1", "round")) < 2:
        assert time.monotonic() < deadline, (tmp_path / "b.log").read_text()[-3000:]
        assert b.poll() is None and a.poll() is None
        time.sleep(0.2)
    os.killpg(b.pid, signal.SIGKILL)
    b.wait()
    deadline = time.monotonic() + 120
    while not any(r.k_active == 1 and r.committed for r in records(tmp_path, "site0", "round")):
        assert time.monotonic() < deadline, (tmp_path / "a.log").read_text()[-3000:]
        time.sleep(0.2)


def final_params(run_dir: Path, site: str) -> list[torch.Tensor]:
    sd = torch.load(run_dir / site / "final_model.pt")
    return list(sd.values())


# codec knobs of the fp8 case: they must reach every site's codec and the simulator's alike
FP8_KNOBS = {"diloco.stochastic_rounding": True, "diloco.codec_chunk": 256, "diloco.codec_scale_dtype": "bf16"}


@pytest.mark.parametrize("algorithm, compression, mode, knobs", [
    ("diloco", "none", "sync", {}), ("diloco", "int8", "sync", {}),
    ("diloco", "powersgd:4+int8", "sync", {}), ("diloco", "fp8", "sync", FP8_KNOBS),
    ("diloco", "topk:0.05+int8", "sync", {}), ("diloco", "sparse:0.05", "sync", {}),
    ("ddp", "none", "sync", {}), ("diloco", "int8", "overlap", {}),
    ("diloco", "none", "overlap", {"diloco.overlap_mix": 0.3})])
def test_two_sites_equal_the_simulator(tmp_path, lighthouse2, algorithm, compression, mode, knobs):
    # min_sites=2: both sites in every quorum, as in the simulator
    cfgs = [tiny_config(tmp_path, i, **{"diloco.min_sites": 2, "diloco.compression": compression,
                                        "diloco.algorithm": algorithm, "diloco.mode": mode, **knobs})
            for i in range(2)]
    procs = [start_site(c, lighthouse2, tmp_path / f"site{i}.log") for i, c in enumerate(cfgs)]
    codes = wait_all(procs, 240)
    assert codes == [0, 0], [(tmp_path / f"site{i}.log").read_text()[-3000:] for i in range(2)]

    sim = simulate(cfgs[0])
    for site in ("site0", "site1"):
        got = final_params(tmp_path, site)
        assert len(got) == len(sim.params)
        for g, s in zip(got, sim.params, strict=True):
            torch.testing.assert_close(g, s, rtol=1e-5, atol=1e-7)
        rounds = records(tmp_path, site, "round")
        assert [r.round for r in rounds] == [1, 2, 3]
        # overlap: round 1 has no exchange of its own yet to wait for
        assert all(r.k_active == 2 and r.committed for r in rounds[1 if mode == "overlap" else 0:])
        assert all(r.staleness == (1 if mode == "overlap" else 0) for r in rounds)
        assert rounds[-1].val_ppl == pytest.approx(sim.rounds[-1].val_ppl, rel=1e-4)
        assert all(r.bytes_sent > 0 for r in rounds[1 if mode == "overlap" else 0:])
        parts = [(r.quorum_s, r.weight_s, r.payload_s) for r in rounds[1 if mode == "overlap" else 0:]]
        if algorithm == "ddp":  # gradients every step: no round exchange to split
            assert all(p == (None, None, None) for p in parts)
        else:
            assert all(q > 0 and w > 0 and x > 0 for q, w, x in parts), parts
        if algorithm == "diloco" and mode == "sync":  # the parts lie inside the exchange's wall time
            assert all(sum(p) <= r.sync_s for p, r in zip(parts, rounds, strict=True)), (parts, rounds)
    events = [e.event for e in records(tmp_path, "site0", "event")]
    assert events[0] == "start" and events[-1] == "stopped" and "checkpoint" in events
    start = next(e for e in records(tmp_path, "site0", "event") if e.event == "start")
    assert start.detail["payload_bytes"] == payload_bytes(compression, [tuple(p.shape) for p in sim.params],
                                                cfgs[0].diloco.codec_options())
    if knobs:  # the knobs reach the codec: the defaults (round-to-nearest, fp32 scales) end elsewhere
        plain = simulate(tiny_config(tmp_path / "plain", 0, **{
            "diloco.min_sites": 2, "diloco.compression": compression, "diloco.mode": mode}))
        assert any(not torch.equal(a, b) for a, b in zip(plain.params, sim.params, strict=True))


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_killed_site_lets_the_other_continue_and_rejoins_by_healing(tmp_path, lighthouse, mode):
    """overlap: a source's round already counts the exchange it has in flight; the join added one more, so the
    healed site ended a round early and the other made its last exchange alone (two θs)."""
    rounds, h = 150, 5  # long enough that the survivor is still going when the killed site returns
    cfgs = [tiny_config(tmp_path, i, **{"diloco.rounds": rounds, "diloco.h": h, "data.batch_size": 16,
                                        "data.seq_len": 64, "diloco.mode": mode}) for i in range(2)]
    a = start_site(cfgs[0], lighthouse, tmp_path / "a.log")
    b = start_site(cfgs[1], lighthouse, tmp_path / "b.log")
    kill_after_two_rounds(tmp_path, a, b)
    # site0 went on alone: K_active = 1 and the outer lr halved (elastic)
    solo = [r for r in records(tmp_path, "site0", "round") if r.k_active == 1][0]
    assert solo.outer_lr == pytest.approx(0.7 / 2)
    # restart site1 from its checkpoint: it heals from site0 and both end equal
    b2 = start_site(cfgs[1], lighthouse, tmp_path / "b2.log")
    codes = wait_all([a, b2], 240)
    assert codes == [0, 0], (tmp_path / "b2.log").read_text()[-3000:]
    events = records(tmp_path, "site1", "event")
    starts = [e for e in events if e.event == "start"]
    assert starts[-1].detail["resumed_from"] is not None
    assert any(e.event == "heal" for e in events), [e.event for e in events]
    for x, y in zip(final_params(tmp_path, "site0"), final_params(tmp_path, "site1"), strict=True):
        assert torch.equal(x, y)
    r1 = records(tmp_path, "site1", "round")
    assert r1[-1].round == rounds and all(r.k_active == 2 for r in r1[-3:])
    steps = [s.step for s in records(tmp_path, "site1", "step")]
    assert steps[-1] == rounds * h  # round and step numbers continue monotonically after the restart
    nums = [r.round for r in r1]
    assert nums == sorted(set(nums))  # strictly increasing


@pytest.mark.parametrize("layout", [{"parallel.tp": 2}, {"parallel.dp_shard": 2}])
def test_two_sites_with_two_processes_each_equal_the_simulator(tmp_path, lighthouse2, layout):
    """Each local rank exchanges only its own shard with the same rank of the other site."""
    cfgs = [tiny_config(tmp_path, i, **{"diloco.min_sites": 2, **layout}) for i in range(2)]
    procs = [start_site(c, lighthouse2, tmp_path / f"site{i}.log", nproc=2) for i, c in enumerate(cfgs)]
    codes = wait_all(procs, 400)
    assert codes == [0, 0], [(tmp_path / f"site{i}.log").read_text()[-3000:] for i in range(2)]
    # tp: both ranks read the site's data as one process would, so the simulator is the reference;
    # dp_shard: the ranks split the site's data (tests/integration/test_parallel.py compares that case)
    sim = simulate(tiny_config(tmp_path / "sim", 0, **{"diloco.min_sites": 2})) if "parallel.tp" in layout else None
    for site in ("site0", "site1"):
        rounds = records(tmp_path, site, "round")
        assert [r.round for r in rounds] == [1, 2, 3] and all(r.k_active == 2 for r in rounds)
        if sim is not None:
            got = final_params(tmp_path, site)
            for g, s in zip(got, sim.params, strict=True):
                torch.testing.assert_close(g, s, rtol=1e-4, atol=1e-5)
    for x, y in zip(final_params(tmp_path, "site0"), final_params(tmp_path, "site1"), strict=True):
        assert torch.equal(x, y)
