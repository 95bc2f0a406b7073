"""The async site's background push (trainer.modes.async_mode.AsyncExchange) against a fake service: the
push goes out at the round's end, the newest θ lands land_step(H) steps into the next round with the
same rebase the simulator's async mode makes (trainer.simulate), and only what is not back by then
is waited for."""

from __future__ import annotations

import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

import trainer.modes.async_mode as am
from trainer.modes.async_mode import AsyncExchange
from trainer.rules.config import from_dict


class FakeClient:
    """θ and its version; `push_pull` applies nothing, it answers with the θ it holds then."""

    def __init__(self, version: int, theta: list[float]):
        self.version, self.theta = version, torch.tensor(theta)
        self.pushed: list[int] = []  # the base version of each push
        self.pulls = 0
        self.gate = threading.Event()  # push_pull waits for it (a slow link)
        self.gate.set()

    def push_pull(self, site, base, codec, phases, shapes):
        self.gate.wait(10)
        self.pushed.append(base)
        self.version += 1
        answer = {"version": self.version, "staleness": self.version - 1 - base, "lr": 0.5, "scale": 1.0}
        return answer, 8, [self.theta.clone()], 8

    def state(self) -> dict:
        return {"version": self.version}

    def pull(self, shapes):
        self.pulls += 1
        return self.version, [self.theta.clone()], 8

    def close(self) -> None:
        pass


class Outer:
    def __init__(self, theta: list[float]):
        self.params = [torch.tensor(theta)]

    def deltas(self, local):
        return [g - p.detach() for g, p in zip(self.params, local, strict=True)]

    def copy_to(self, local):
        with torch.no_grad():
            for g, p in zip(self.params, local, strict=True):
                p.copy_(g)


def exchange(monkeypatch, **diloco) -> tuple[AsyncExchange, SimpleNamespace, FakeClient]:
    monkeypatch.setattr(am, "encode_delta", lambda comp, deltas: ([b"d" * 8], deltas))
    monkeypatch.setattr(am, "POLL_S", 0.01)
    cfg = from_dict({"diloco": {"mode": "async", "h": 10, "overlap_land": 0.2, **diloco}})
    events: list[str] = []
    run = SimpleNamespace(cfg=cfg, world=1, rank=0, round=0, stop_requested=False, timeout=timedelta(seconds=30),
                          site=SimpleNamespace(params=[torch.nn.Parameter(torch.tensor([1.0, 2.0]))]),
                          outer=Outer([1.0, 2.0]), comp=None,
                          metrics=SimpleNamespace(event=lambda kind, msg, **kw: events.append(kind)))
    client = FakeClient(0, [5.0, 5.0])
    monkeypatch.setattr(am.ServiceClient, "from_config", classmethod(lambda cls, *a, **k: client))
    ex = AsyncExchange(run)
    ex.begin_round()
    return ex, run, client


def until(cond) -> None:
    done = threading.Event()
    for _ in range(500):
        if cond():
            return
        done.wait(0.01)
    raise AssertionError("timed out")


def step(run, by: list[float]) -> None:
    with torch.no_grad():
        run.site.params[0].sub_(torch.tensor(by))


def test_the_push_runs_behind_compute_and_its_theta_lands_mid_round_keeping_progress(monkeypatch):
    ex, run, client = exchange(monkeypatch)
    step(run, [0.5, 0.5])  # round 1's progress
    client.gate.clear()  # the link is slow: the push is not back before the round ends
    res = ex.finish(last=False)
    assert not res.committed and res.bytes_sent == 8 and res.sync_s == 0.0  # nothing waited for
    assert ex.in_flight and run.site.params[0].tolist() == [0.5, 1.5]  # the site goes on from its own
    ex.begin_round()
    step(run, [0.25, -0.25])  # round 2 so far
    assert ex.after_step(1, 10) == 0.0  # land_step(10, 0.2) = 2
    client.gate.set()
    waited = ex.after_step(2, 10)
    assert waited >= 0.0 and client.pushed == [0] and ex.version == 1 and not ex.in_flight
    # θ as the push left it, minus this round's progress since it began: what trainer.simulate does
    assert run.site.params[0].tolist() == pytest.approx([4.75, 5.25])
    assert run.outer.params[0].tolist() == [5.0, 5.0]
    step(run, [1.0, 1.0])
    res = ex.finish(last=False)  # round 2's record: round 1's push, landed
    assert res.committed and res.staleness == 0 and res.outer_lr == 0.5 and res.bytes_recv == 8
    until(lambda: len(client.pushed) == 2)
    assert client.pushed == [0, 1]  # round 2's push names the version it rebased on
    ex.close()


def test_a_site_that_moves_theta_before_the_landing_is_pulled_again(monkeypatch):
    ex, run, client = exchange(monkeypatch)
    ex.finish(last=False)
    until(lambda: client.pushed)  # the push is back...
    client.version, client.theta = 7, torch.tensor([9.0, 9.0])  # ...and other sites pushed since
    ex.begin_round()
    until(lambda: client.pulls)
    ex.after_step(2, 10)
    assert ex.version == 7 and run.outer.params[0].tolist() == [9.0, 9.0]
    assert run.site.params[0].tolist() == [9.0, 9.0]  # no progress yet this round
    ex.close()


def test_turns_and_the_last_push_are_waited_for_and_adopted(monkeypatch):
    for over, last in (({"async_turns": True}, False), ({}, True)):
        ex, run, client = exchange(monkeypatch, **over)
        step(run, [0.5, 0.5])
        res = ex.finish(last=last)
        assert not ex.in_flight and client.pushed == [0] and ex.version == 1
        assert run.site.params[0].tolist() == [5.0, 5.0]  # θ as the push left it, everywhere
        assert res.sync_s > 0 and res.bytes_sent == 8 and res.bytes_recv == 8
        assert ex.after_step(2, 10) == 0.0  # nothing in flight to land
        ex.close()
