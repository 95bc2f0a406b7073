"""The async site's mid-round pull (trainer.async_mode.AsyncExchange.after_step), against a fake service:
the same rebase the simulator's async mode makes (trainer.simulate), at the same step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trainer.async_mode import AsyncExchange
from trainer.config import from_dict


class FakeClient:
    def __init__(self, version: int, theta: list[torch.Tensor]):
        self.version, self.theta, self.pulls = version, theta, 0

    def state(self) -> dict:
        return {"version": self.version}

    def pull(self, shapes):
        self.pulls += 1
        return self.version, [t.clone() for t in self.theta], 4 * sum(t.numel() for t in self.theta)


def exchange(version: int, service_version: int, **diloco) -> tuple[AsyncExchange, SimpleNamespace, FakeClient]:
    cfg = from_dict({"diloco": {"mode": "async", "h": 10, **diloco}})
    site = SimpleNamespace(params=[torch.nn.Parameter(torch.tensor([1.0, 2.0]))])
    outer = SimpleNamespace(params=[torch.tensor([1.0, 2.0])])
    run = SimpleNamespace(cfg=cfg, world=1, site=site, outer=outer)
    ex = AsyncExchange.__new__(AsyncExchange)  # no service connection: the fake stands in for it
    client = FakeClient(service_version, [torch.tensor([5.0, 5.0])])
    ex.run, ex.leader, ex.shapes, ex.version, ex.client = run, True, [(2,)], version, client
    ex.begin_round()
    return ex, run, client


def test_mid_round_pull_rebases_on_the_newer_theta_keeping_the_rounds_progress():
    ex, run, client = exchange(version=1, service_version=3, overlap_land=0.2)  # land_step(10, 0.2) = 2
    with torch.no_grad():
        run.site.params[0].sub_(torch.tensor([0.5, -0.25]))  # the round's progress so far
    assert ex.after_step(1, 10) == 0.0 and client.pulls == 0  # not yet
    assert ex.after_step(2, 10) >= 0.0 and client.pulls == 1
    # θ_new − own progress, the base is θ_new at its version: what trainer.simulate does
    assert run.site.params[0].tolist() == pytest.approx([4.5, 5.25])
    assert run.outer.params[0].tolist() == [5.0, 5.0]
    assert ex.version == 3 and ex.recv == 8
    assert ex.after_step(10, 10) == 0.0 and client.pulls == 1  # never at the round's end (the push pulls)


def test_no_pull_when_theta_did_not_move_or_sites_take_turns():
    ex, run, client = exchange(version=3, service_version=3, overlap_land=0.2)
    ex.after_step(2, 10)
    assert client.pulls == 0 and run.site.params[0].tolist() == [1.0, 2.0] and ex.recv == 0
    ex, run, client = exchange(version=1, service_version=3, overlap_land=0.2, async_turns=True)
    ex.after_step(2, 10)
    assert client.pulls == 0 and ex.version == 1
