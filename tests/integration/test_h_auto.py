"""h = "auto": the sites agree on a new H from the measured sync time, all switch together."""

from __future__ import annotations

import pytest
import torch

from tests.integration.dist_helpers import start_site, tiny_config
from tests.integration.test_trainer_dist import _lighthouse, final_params, records, wait_all

pytestmark = pytest.mark.slow


def test_sites_raise_h_together_when_sync_is_expensive(tmp_path):
    lh = _lighthouse(2)
    try:
        # a budget so small that even loopback sync needs a larger H than the start
        cfgs = [tiny_config(tmp_path, i, **{"diloco.min_sites": 2, "diloco.h_auto": True, "diloco.h": 10,
                                            "diloco.h_min": 10, "diloco.h_max": 60, "diloco.sync_budget": 0.01,
                                            "diloco.rounds": 4, "train.steps": 200}) for i in range(2)]
        procs = [start_site(c, lh.address(), tmp_path / f"s{i}.log") for i, c in enumerate(cfgs)]
        assert wait_all(procs, 300) == [0, 0], (tmp_path / "s0.log").read_text()[-2000:]
    finally:
        lh.shutdown()
    hs = {site: [r.h for r in records(tmp_path, site, "round")] for site in ("site0", "site1")}
    assert hs["site0"] == hs["site1"]  # every round, the same H at both sites
    assert hs["site0"][0] == 10 and max(hs["site0"]) > 10
    changes = [e for e in records(tmp_path, "site0", "event") if e.event == "h_changed"]
    assert changes and changes[0].detail["old"] == 10 and changes[0].detail["new"] == hs["site0"][changes[0].round]
    steps = [s.step for s in records(tmp_path, "site0", "step")]
    assert steps[-1] == sum(hs["site0"])
    for a, b in zip(final_params(tmp_path, "site0"), final_params(tmp_path, "site1"), strict=True):
        assert torch.equal(a, b)
