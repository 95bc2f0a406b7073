"""h_policy = "time" with a site slowed 3x (SIGSTOP/SIGCONT duty cycle on its process tree): the
faster site takes more inner steps per round, the slower fewer, both end on the same θ, and the lr
schedule ends where the rounds end at both sites."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.integration.dist_helpers import start_site, tiny_config
from tests.integration.test_trainer_dist import _lighthouse, final_params, records, wait_all
from trainer.rules.schedule import lr_at

pytestmark = pytest.mark.slow


def tree(pid: int) -> list[int]:
    """`pid` and its descendants (torchrun starts its workers in their own sessions)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def signal_all(pids: list[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def slow_down(pid: int, factor: float, stop: threading.Event, period_s: float = 0.1) -> None:
    """Run the process tree of `pid` 1/factor of the time until `stop` is set."""
    pids: list[int] = []
    try:
        while not stop.is_set():
            pids = tree(pid)
            signal_all(pids, signal.SIGSTOP)
            time.sleep(period_s * (1 - 1 / factor))
            signal_all(pids, signal.SIGCONT)
            time.sleep(period_s / factor)
    finally:
        signal_all(pids, signal.SIGCONT)


def test_the_faster_site_takes_more_steps_and_both_end_on_one_theta(tmp_path):
    lh = _lighthouse(2)
    stop = threading.Event()
    try:
        cfgs = [tiny_config(tmp_path, i, **{"diloco.min_sites": 2, "diloco.h": 16, "diloco.rounds": 6,
                                            "diloco.h_policy": "time", "train.eval_every": 0}) for i in range(2)]
        procs = [start_site(c, lh.address(), tmp_path / f"s{i}.log") for i, c in enumerate(cfgs)]
        slower = threading.Thread(target=slow_down, args=(procs[1].pid, 3.0, stop), daemon=True)
        slower.start()
        codes = wait_all(procs, 400)
        stop.set()
        slower.join(5)
        assert codes == [0, 0], (tmp_path / "s1.log").read_text()[-3000:]
    finally:
        stop.set()
        lh.shutdown()
    hs = {site: [r.h for r in records(tmp_path, site, "round")] for site in ("site0", "site1")}
    assert len(hs["site0"]) == len(hs["site1"]) == 6
    assert hs["site0"][0] == hs["site1"][0] == 16  # nothing measured yet: H steps
    # from round 2 on, the window (H x the median step time) gives the faster site more steps
    assert sum(hs["site0"][1:]) > 1.5 * sum(hs["site1"][1:]), hs
    assert all(1 <= h <= 64 for h in hs["site0"] + hs["site1"]), hs  # at most MAX_TIME_STEPS x H
    for site in ("site0", "site1"):
        steps = records(tmp_path, site, "step")
        assert steps[-1].step == sum(hs[site])
        # the schedule follows the rounds: the last round runs at its end's lr, however many steps a site took
        assert steps[-1].lr <= lr_at(5 * 16, cfgs[0].total_steps, cfgs[0].train) + 1e-12
    for a, b in zip(final_params(tmp_path, "site0"), final_params(tmp_path, "site1"), strict=True):
        assert torch.equal(a, b)
