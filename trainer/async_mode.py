"""Async (decoupled) mode of a site: pull θ → H inner steps → push Δ(τ) and get θ back, at the site's own pace.

The outer parameter service (trainer.outer_service) owns θ and the outer optimizer; this module is
the site's exchange with it (trainer.service_client is the HTTP client). Local rank 0 talks to the
service; the site's other processes (plain data parallel) get θ and the push's outcome by
broadcast inside the site.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from trainer.exchange import Exchange, ExchangeResult, Preempted, RoundContext
from trainer.outer import land_step, overlap_rebase
from trainer.param_service import encode_delta
from trainer.service_client import ServiceClient, ServiceRefused


def _broadcast_obj(obj, world: int):
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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


class AsyncExchange(Exchange):
    """Push this round's Δ (computed from θ at `version`) and start the next round from θ as that push
    left it (one round trip; a refused push pulls the service's newest θ instead)."""

    def __init__(self, run: RoundContext):
        super().__init__(run)
        self.leader = run.rank == 0
        self.shapes = [tuple(p.shape) for p in run.outer.params]
        self.version = 0  # the service's version of θ this site's round started from (or rebased on)
        self.start: list[torch.Tensor] = []  # the site's parameters when the round began
        self.recv = 0  # bytes of θ pulled inside the round (the mid-round pull)
        self.client = ServiceClient.from_config(run.cfg, run.timeout.total_seconds(),
                                                stop=lambda: run.stop_requested) if self.leader else None

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
        self.recv = 0

    def after_step(self, done: int, h: int) -> float:
        """land_step(h) steps into the round: pull θ if other sites moved it, and rebase on it."""
        d = self.run.cfg.diloco
        if d.async_turns or done != land_step(h, d.overlap_land) or done == h:
            return 0.0
        run = self.run
        t0 = time.perf_counter()
        newer, theta = None, None
        if self.client is not None:
            if int(self.client.state()["version"]) != self.version:
                version, theta, self.recv = self.client.pull(self.shapes)
                newer = version
        newer = _broadcast_obj(newer, run.world)
        if newer is not None:
            theta = _broadcast_params(run, theta)
            own = [s - p.detach().float().cpu() for s, p in zip(self.start, run.site.params, strict=True)]
            with torch.no_grad():
                for g, t in zip(run.outer.params, theta, strict=True):
                    g.copy_(t)
                overlap_rebase(run.site.params, run.outer.params, own)
            self.version = newer
        return time.perf_counter() - t0  # the wait leaves the round's compute time

    def finish(self, last: bool) -> ExchangeResult:
        run = self.run
        t0 = time.perf_counter()
        deltas = run.outer.deltas(run.site.params)
        res, theta = None, None
        if self.client is not None:
            phases, _ = encode_delta(run.comp, deltas)
            if run.cfg.diloco.async_turns:
                self._wait_turn()
            try:
                ans, sent, theta, recv = self.client.push_pull(run.cfg.run.site, self.version,
                                                               run.cfg.diloco.compression, phases, self.shapes)
                res = ExchangeResult(committed=True, applied=True, k_active=1, staleness=int(ans["staleness"]),
                                     outer_lr=float(ans["lr"]) * float(ans["scale"]), bytes_sent=sent,
                                     bytes_recv=recv)
                version = int(ans["version"])
                if float(ans.get("clip", 1.0)) < 1.0:
                    res.rejected = (run.cfg.run.site,)
                    run.metrics.event("rejected", f"round {run.round + 1}: the outer service clipped this site's "
                                      f"push by x{float(ans['clip']):.3g} (norm over its bound)",
                                      round=run.round + 1, site_rejected=run.cfg.run.site, reason="clipped")
            except ServiceRefused as e:
                if "HTTP 401" in str(e) or "HTTP 400" in str(e):
                    raise  # a wrong token or a codec mismatch does not heal by itself
                # 409: the service restarted behind our base version; this Δ is lost, pull and go on
                run.metrics.event("error", f"push refused, round not applied: {e}", round=run.round + 1)
                res = ExchangeResult()
                version, theta, res.bytes_recv = self.client.pull(self.shapes)
            res.bytes_recv += self.recv
            res = (version, res)
        version, res = _broadcast_obj(res, run.world)
        self.version = version
        _adopt(run, _broadcast_params(run, theta))
        res.sync_s = time.perf_counter() - t0
        return res

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
        if self.client is not None:
            self.client.close()
            self.client = None
