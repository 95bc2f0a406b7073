"""Async (decoupled) mode of a site: H inner steps → push Δ(τ) in the background → land θ, at the site's own pace.

The outer parameter service (trainer.service.outer_service) owns θ and the outer optimizer; this module is
the site's exchange with it (trainer.service.service_client is the HTTP client). Local rank 0 talks to the
service; the site's other processes (plain data parallel) get θ and the push's outcome by
broadcast inside the site.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer import jsonwire
from trainer.modes.exchange import Exchange, ExchangeResult, Preempted, RoundContext
from trainer.outer.optimizer import overlap_rebase
from trainer.rules.outer_rule import land_step, landing
from trainer.service.param_service import encode_delta
from trainer.service.service_client import ServiceClient, ServiceRefused

POLL_S = 0.2  # how often a site whose push came back asks whether θ moved on before its update lands


def _broadcast_obj(obj, world: int):
    """`obj` of local rank 0 on every process of the site: typed JSON in tensors, never a pickle."""
    if world == 1:
        return obj
    return jsonwire.broadcast(obj, src=0)


def _result_to_wire(res: ExchangeResult) -> dict:
    return {f.name: getattr(res, f.name) for f in dataclasses.fields(res)}


def _result_from_wire(d: dict) -> ExchangeResult:
    return ExchangeResult(**d)


def _broadcast_params(run: RoundContext, theta: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """θ from local rank 0 to the site's other processes."""
    if run.world == 1:
        assert theta is not None
        return theta
    shapes = [tuple(p.shape) for p in run.outer.params]
    n = sum(math.prod(s) for s in shapes)
    dev = run.device if dist.get_backend() == "nccl" else torch.device("cpu")
    flat = torch.cat([t.reshape(-1) for t in theta]).to(dev) if theta is not None else torch.empty(n, device=dev)
    dist.broadcast(flat, src=0)
    out, off = [], 0
    flat = flat.cpu()
    for s in shapes:
        k = math.prod(s)
        out.append(flat[off:off + k].view(s))
        off += k
    return out


@torch.no_grad()
def _adopt(run: RoundContext, theta: list[torch.Tensor]) -> None:
    """θ becomes the base of the next round and the site's parameters."""
    for g, t in zip(run.outer.params, theta, strict=True):
        g.copy_(t)
    run.outer.copy_to(run.site.params)


@dataclass(slots=True)
class _Pushed:
    """What a background push brought back: θ (the newest pulled before the update landed)."""

    version: int = 0
    theta: list[torch.Tensor] | None = None
    answer: dict | None = None  # the service's answer to the push (None: refused)
    refused: str = ""  # why the service refused it (409: it restarted behind our base version)
    recv: int = 0


class AsyncExchange(Exchange):
    """Push this round's Δ (computed from θ at `version`) and go on computing, as overlap does.

    The push runs in the background and brings back θ as it left it (one round trip); until the
    update lands, land_step(H, diloco.overlap_land) steps into the next round, the site pulls θ
    again whenever another site moved it. At the landing the site rebases on the newest θ keeping
    its own progress since the round began, and names that θ's version as its next push's base.
    Only a push not back by then is waited for (the site's exposed sync time). With
    diloco.async_turns the push is waited for at the round's end instead, in site order
    (trainer.simulate's run_async is the reference for both).
    """

    def __init__(self, run: RoundContext):
        super().__init__(run)
        self.leader = run.rank == 0
        self.shapes = [tuple(p.shape) for p in run.outer.params]
        self.version = 0  # the service's version of θ this site's round started from (or rebased on)
        self.start: list[torch.Tensor] = []  # the site's parameters when the round began
        self.in_flight = False  # a push is out and its θ has not landed (every rank knows)
        self.pending: Future[_Pushed] | None = None  # that push (local rank 0 only)
        self.landing = threading.Event()  # set when the update lands: the background pulls stop
        self.landed: ExchangeResult | None = None  # the previous push's outcome, once landed this round
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="async-push")
        self.client = ServiceClient.from_config(run.cfg, run.timeout.total_seconds(),
                                                stop=lambda: run.stop_requested) if self.leader else None
        if self.client is not None:  # a service that stops answering is an event (issue 41)
            self.client.on_event = lambda kind, msg, **d: run.metrics.event(kind, msg, **d)

    def join(self) -> None:
        """The first site's θ_0 seeds the service; everyone then starts from its current θ.

        A fresh run waits (up to run.startup_wait_s) for all sites, so that no site trains alone
        while another is still importing torch; a restarted site goes straight on.
        """
        run, cfg = self.run, self.run.cfg
        d = cfg.diloco
        version, theta, joined = 0, None, 1
        if self.client is not None:
            self.client.init(run.outer.params, cfg.run.site)  # θ_0 is taken only if no site seeded it yet
            fresh = run.resumed_from is None and cfg.run.resume_round < 0
            if fresh and d.sites > 1:
                joined = self.client.wait_joined(d.sites, cfg.run.startup_wait_s)
            if fresh and d.async_turns:
                # every site seeds the same θ_0; a pull could already see the first turn's push
                theta = [p.detach().clone() for p in run.outer.params]
            else:
                version, theta, _ = self.client.pull(self.shapes)
        self.version = _broadcast_obj(version if self.leader else None, run.world)
        _adopt(run, _broadcast_params(run, theta))
        if run.h_done:  # resumed mid-round: that partial round was based on a θ the service moved past
            run.h_done = 0
        joined = _broadcast_obj(joined if self.leader else None, run.world)
        run.metrics.event("quorum", f"joined the outer service at version {self.version} ({joined} of "
                          f"{d.sites} sites there)", round=run.round, k_active=joined, version=self.version,
                          service=cfg.run.service_url)

    def begin_round(self) -> None:
        self.start = [p.detach().float().cpu().clone() for p in self.run.site.params]
        self.landed = None

    def after_step(self, done: int, h: int) -> float:
        if not self.in_flight or done != land_step(h, landing(self.run.cfg.diloco)) or done == h:
            return 0.0
        self.landed = self._land()
        return self.landed.sync_s  # only the wait shows (compute leaves it out)

    def _push(self, phases: list[bytes], base: int, poll: bool) -> _Pushed:
        """(background) Push, get θ back; then, until the landing, pull θ whenever it moved on."""
        assert self.client is not None
        run, out = self.run, _Pushed()
        try:
            out.answer, _, out.theta, out.recv = self.client.push_pull(
                run.cfg.run.site, base, run.cfg.diloco.compression, phases, self.shapes)
            out.version = int(out.answer["version"])
        except ServiceRefused as e:
            if "HTTP 401" in str(e) or "HTTP 400" in str(e):
                raise  # a wrong token or a codec mismatch does not heal by itself
            out.refused = str(e)
            out.version, out.theta, out.recv = self.client.pull(self.shapes)
        while poll and not self.landing.wait(POLL_S):
            if int(self.client.state()["version"]) > out.version:
                out.version, out.theta, got = self.client.pull(self.shapes)
                out.recv += got
        return out

    def _land(self, keep_progress: bool = True) -> ExchangeResult:
        """Wait for the push in flight; rebase on the newest θ it brought (or adopt it)."""
        run = self.run
        t0 = time.perf_counter()
        box, theta = None, None
        if self.pending is not None:
            self.landing.set()
            out = self.pending.result()
            res = ExchangeResult(bytes_recv=out.recv)  # its bytes sent count in the round that pushed
            if out.answer is not None:
                ans = out.answer
                res.committed = res.applied = True
                res.k_active, res.staleness = 1, int(ans["staleness"])
                res.outer_lr = float(ans["lr"]) * float(ans["scale"])
                if float(ans.get("clip", 1.0)) < 1.0:
                    res.rejected = (run.cfg.run.site,)
            box = (out.version, _result_to_wire(res), float((out.answer or {}).get("clip", 1.0)), out.refused)
            theta = out.theta
        elif self.leader:
            raise RuntimeError("async: no push in flight to land")
        self.pending, self.in_flight = None, False
        version, wire, clip, refused = _broadcast_obj(box, run.world)
        res = _result_from_wire(wire)
        theta = _broadcast_params(run, theta)
        if clip < 1.0:
            run.metrics.event("rejected", f"round {run.round}: the outer service clipped this site's push by "
                              f"x{clip:.3g} (norm over its bound)", round=run.round,
                              site_rejected=run.cfg.run.site, reason="clipped")
        if refused:
            run.metrics.event("error", f"push refused, round not applied: {refused}", round=run.round)
        if keep_progress:
            own = [s - p.detach().float().cpu() for s, p in zip(self.start, run.site.params, strict=True)]
            with torch.no_grad():
                for g, t in zip(run.outer.params, theta, strict=True):
                    g.copy_(t)
                overlap_rebase(run.site.params, run.outer.params, own)
        else:
            _adopt(run, theta)
        self.version = version
        res.sync_s = time.perf_counter() - t0
        return res

    def finish(self, last: bool) -> ExchangeResult:
        run = self.run
        turns = run.cfg.diloco.async_turns
        res = self.landed if self.landed is not None else self._land() if self.in_flight else ExchangeResult()
        self.landed = None
        deltas = run.outer.deltas(run.site.params)  # progress against the θ this round rebased on
        t0 = time.perf_counter()
        if self.leader:
            phases, _ = encode_delta(run.comp, deltas)
            res.bytes_sent = sum(len(b) for b in phases)
            if turns:
                self._wait_turn()
            self.landing = threading.Event()
            self.pending = self._pool.submit(self._push, phases, self.version, not (turns or last))
        self.in_flight = True
        if turns or last:  # wait now; the run's last push: end on the θ it produced, everywhere
            final = self._land(keep_progress=False)
            if turns:  # its turn's wait and the push, all exposed
                final.sync_s, final.bytes_sent = time.perf_counter() - t0, res.bytes_sent
                return final
            res.sync_s += time.perf_counter() - t0
            res.bytes_recv += final.bytes_recv
        return res

    def drain(self, timeout_s: float | None = None) -> None:
        """Let the push in flight reach the service, so this round's progress is not lost."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self.landing.set()
            pending.result(timeout=timeout_s)

    def _wait_turn(self) -> None:
        """async_turns: wait until θ's version is this site's turn (its j-th push makes j*K+i+1)."""
        run = self.run
        k, i = run.cfg.diloco.sites, run.cfg.run.site_index
        turn = run.round * k + i
        deadline = time.monotonic() + run.timeout.total_seconds()
        while (version := int(self.client.state()["version"])) < turn:
            if run.stop_requested:
                raise Preempted()
            if time.monotonic() > deadline:
                raise TimeoutError(f"async_turns: θ is at version {version}, this site's turn is {turn}; "
                                   f"no push from the sites before it within {run.timeout.total_seconds():.0f} s")
            time.sleep(0.02)

    def close(self) -> None:
        self.landing.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.client is not None:
            self.client.close()
            self.client = None
