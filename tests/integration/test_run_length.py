"""Run length (issue 19): an h = "auto" run ends on train.steps, its lr reaching the floor on the last step."""

from __future__ import annotations

import pytest

from tests.integration.dist_helpers import start_site, tiny_config
from tests.integration.test_trainer_dist import _lighthouse, records, wait_all

pytestmark = pytest.mark.slow


def test_auto_h_run_reaches_lr_floor_on_its_last_step(tmp_path):
    lh = _lighthouse(2)
    try:
        # a sync budget so small that loopback sync raises H past its start: the rounds change length
        over = {"diloco.min_sites": 2, "diloco.h": "auto", "diloco.h_min": 10, "diloco.h_max": 40,
                "diloco.sync_budget": 0.01, "diloco.rounds": 2, "train.steps": 75, "train.min_lr_ratio": 0.1}
        cfgs = [tiny_config(tmp_path, i, **over) for i in range(2)]
        procs = [start_site(c, lh.address(), tmp_path / f"s{i}.log") for i, c in enumerate(cfgs)]
        assert wait_all(procs, 300) == [0, 0], (tmp_path / "s0.log").read_text()[-2000:]
    finally:
        lh.shutdown()
    for site in ("site0", "site1"):
        hs = [r.h for r in records(tmp_path, site, "round")]
        assert hs[0] == 10 and max(hs) > 10 and sum(hs) == 75  # H changed; the run ended on train.steps
        steps = records(tmp_path, site, "step")
        assert [s.step for s in steps] == list(range(1, 76))
        floor = cfgs[0].train.lr * 0.1
        assert steps[-1].lr == pytest.approx(floor, rel=1e-9)
        assert min(s.lr for s in steps[:-1]) > floor * (1 + 1e-9)
