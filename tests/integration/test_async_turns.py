"""Async mode with a fixed arrival pattern (`diloco.async_turns`): two real sites and the real outer
service end with the simulator's θ, up to float tolerance, whatever the sites' real timing."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tests.integration.dist_helpers import start_site, tiny_config
from tests.integration.test_async_mode import rounds_of, running_service

pytestmark = pytest.mark.slow
ROUNDS = 4


def test_two_async_sites_taking_turns_equal_the_simulator(tmp_path):
    from trainer.simulate import simulate

    with running_service(tmp_path, sites=2, async_turns=True) as (url, keys, client):
        over = {"diloco.mode": "async", "diloco.async_turns": True, "run.service_url": url,
                "run.service_cert": str(keys.cert), "run.service_token_file": str(keys.token),
                "diloco.h": 8, "diloco.rounds": ROUNDS}
        cfgs = [tiny_config(tmp_path / "run", i, sites=2, **over) for i in range(2)]
        procs = [start_site(c, "", tmp_path / f"site{i}.log") for i, c in enumerate(cfgs)]
        # once both joined, freeze site 0 for a while: left to itself, site 1 would push all its
        # rounds first; taking turns, it waits for site 0's
        deadline = time.monotonic() + 120
        while len(client.state()["joined"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.killpg(procs[0].pid, signal.SIGSTOP)
        time.sleep(8)
        os.killpg(procs[0].pid, signal.SIGCONT)
        for i, p in enumerate(procs):
            assert p.wait(timeout=300) == 0, (tmp_path / f"site{i}.log").read_text()[-3000:]
        state = client.state()
    # equal speeds in the simulator: pushes arrive 0, 1, 0, 1, ...; each after the first is one version stale
    sim = simulate(cfgs[0])
    assert state["version"] == 2 * ROUNDS and state["staleness_max"] == 1
    recs = [rounds_of(tmp_path / "run", f"site{i}") for i in range(2)]
    assert [r.staleness for r in recs[0]] == [0] + [1] * (ROUNDS - 1)
    assert [r.staleness for r in recs[1]] == [1] * ROUNDS
    # site 1 pushed last: its final parameters are the service's final θ, the simulator's
    got = torch.load(tmp_path / "run" / "site1" / "final_model.pt")
    for g, s in zip(got.values(), sim.params, strict=True):
        torch.testing.assert_close(g, s, rtol=1e-5, atol=1e-7)
    assert recs[1][-1].val_ppl == pytest.approx(sim.rounds[-1].val_ppl, rel=1e-4)
