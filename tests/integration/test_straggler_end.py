"""Stragglers the quorum went on without.

A straggler the quorum went on without (3 sites, min_sites 2) that asks for its next quorum after the
other two finished the run: torchft would wait out its 15-minute quorum timeout and fail the site. It
reads the run's end on the Lighthouse's status page within seconds (the others announce their end
there), records `ended_behind` and exits 0 without a final model of its own; the two that finished end
on one θ. (A site's other ranks learn it from
the site's store: tests/unit/test_lighthouse_status.py.)

A straggler several rounds behind in a quorum of two (2 sites, the default min_sites 1): nobody can vouch
for its peer's step; it refused the heal in every later round and the two ended on different θ. It heals
now (trainer.outer.heal_guard, held to a live site's distance bound)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.integration.dist_helpers import start_site, tiny_config
from tests.integration.test_time_policy import signal_all, tree
from tests.integration.test_trainer_dist import _lighthouse, final_params, records

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def sites(tmp_path: Path, cfgs: list, min_replicas: int):
    """The sites of `cfgs` as torchrun processes on one Lighthouse; whatever still runs at the end is
    continued (a stopped site) and killed."""
    lh = _lighthouse(min_replicas)
    procs: list = []
    try:
        procs += [start_site(c, lh.address(), tmp_path / f"s{i}.log") for i, c in enumerate(cfgs)]
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                signal_all(tree(p.pid), signal.SIGCONT)
                os.killpg(p.pid, signal.SIGKILL)
        lh.shutdown()


def wait_rounds(tmp_path: Path, i: int, n: int, proc, deadline: float) -> None:
    """Until site`i` has recorded `n` rounds (it must not exit first)."""
    while len(records(tmp_path, f"site{i}", "round")) < n:
        assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / f"s{i}.log").read_text()[-3000:]
        time.sleep(0.05)


def events(tmp_path: Path, site: str) -> list[dict]:
    lines = (tmp_path / site / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("kind") == "event"]


@pytest.mark.parametrize("mode", ["sync", "overlap"])  # overlap: stopped mid-exchange, its peers' round failed
def test_a_straggler_left_behind_at_the_end_stops_in_seconds(tmp_path, mode):
    cfgs = [tiny_config(tmp_path, i, sites=3, **{"diloco.min_sites": 2, "diloco.mode": mode, "diloco.h": 8,
                                                 "diloco.rounds": 6, "train.eval_every": 0}) for i in range(3)]
    with sites(tmp_path, cfgs, min_replicas=2) as procs:
        wait_rounds(tmp_path, 1, 1, procs[1], time.monotonic() + 180)
        frozen = tree(procs[1].pid)
        signal_all(frozen, signal.SIGSTOP)  # site1 stops in its round 2; the other two go on without it
        for i in (0, 2):
            assert procs[i].wait(timeout=240) == 0, (tmp_path / f"s{i}.log").read_text()[-3000:]
        signal_all(frozen, signal.SIGCONT)
        t0 = time.monotonic()
        code = procs[1].wait(timeout=90)  # before the fix: the quorum's 900 s timeout, then a failed site
        took = time.monotonic() - t0
    assert code == 0, (tmp_path / "s1.log").read_text()[-3000:]
    assert took < 45, took  # a few probes of the Lighthouse after the others' heartbeats stopped
    rounds = [r.round for r in records(tmp_path, "site1", "round")]
    assert rounds and max(rounds) < 6, rounds
    got = events(tmp_path, "site1")
    ended = [e for e in got if e["event"] == "ended_behind"]
    assert len(ended) == 1, [e["event"] for e in got]
    assert "site0, site2 finished its last round and no other site is left" in ended[0]["message"], ended[0]
    assert f"after round {max(rounds)}" in ended[0]["message"]
    assert "stopped" not in [e["event"] for e in got]
    assert not (tmp_path / "site1" / "final_model.pt").exists()  # θ_final is the others'
    for site in ("site0", "site2"):
        assert [r.round for r in records(tmp_path, site, "round")] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(final_params(tmp_path, "site0"), final_params(tmp_path, "site2"), strict=True):
        assert torch.equal(a, b)


def test_a_site_paused_for_rounds_heals_from_its_only_peer_and_both_end_on_one_theta(tmp_path):
    cfgs = [tiny_config(tmp_path, i, **{"diloco.h": 8, "diloco.rounds": 10, "train.eval_every": 0}) for i in range(2)]
    with sites(tmp_path, cfgs, min_replicas=1) as procs:
        deadline = time.monotonic() + 180
        wait_rounds(tmp_path, 1, 2, procs[1], deadline)
        frozen = tree(procs[1].pid)
        signal_all(frozen, signal.SIGSTOP)  # a long pause (GC, live migration): site0 goes on alone
        wait_rounds(tmp_path, 0, len(records(tmp_path, "site0", "round")) + 3, procs[0], deadline)
        signal_all(frozen, signal.SIGCONT)
        codes = [p.wait(timeout=180) for p in procs]
    assert codes == [0, 0], (tmp_path / "s1.log").read_text()[-3000:]
    kinds = [e["event"] for e in events(tmp_path, "site1")]
    assert "heal" in kinds and "rejected" not in kinds, [e["message"] for e in events(tmp_path, "site1")]
    for site in ("site0", "site1"):
        assert records(tmp_path, site, "round")[-1].round == 10
    for a, b in zip(final_params(tmp_path, "site0"), final_params(tmp_path, "site1"), strict=True):
        assert torch.equal(a, b)
