"""Async (decoupled) mode of a site: pull θ → H inner steps → push Δ(τ) → pull, at the site's own pace.

The outer parameter service (trainer.outer_service) owns θ and the outer optimizer; this module is
its client and the per-site loop. Local rank 0 talks to the service; the site's other processes
(plain data parallel) get θ and the push's outcome by broadcast inside the site.
"""

from __future__ import annotations

import json
import math
import ssl
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from trainer.config import ConfigError, TrainerConfig
from trainer.outer_service import encode_delta, flat_bytes, from_flat, read_token
from trainer.records import RoundRecord

if TYPE_CHECKING:
    from trainer.loop import SiteRun

RETRY_BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)  # waits between tries; the last one repeats


class ServiceUnavailable(RuntimeError):
    """The outer service did not answer within run.service_retry_s."""


class ServiceRefused(RuntimeError):
    """The outer service answered with an error that retrying cannot fix (bad token, bad push)."""


class ServiceClient:
    """httpx client of the outer service: TLS pinned to the run's certificate, bearer token auth."""

    def __init__(self, url: str, *, cert: str, token_file: str, timeout_s: float = 60.0,
                 retry_s: float = 60.0, stop: Callable[[], bool] = lambda: False):
        import httpx

        if not url.startswith("https://"):
            raise ConfigError(f"run.service_url: must be an https:// URL, got {url!r}")
        try:
            ctx = ssl.create_default_context(cafile=cert)  # the run's certificate is the only anchor
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"run.service_cert: cannot load {cert!r}: {e}") from None
        try:
            token = read_token(token_file)
        except ValueError as e:
            raise ConfigError(f"run.service_token_file: {e}") from None
        self.url = url.rstrip("/")
        self.retry_s = retry_s
        self.stop = stop
        self._http = httpx.Client(base_url=self.url, verify=ctx, headers={"Authorization": f"Bearer {token}"},
                                  timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)))

    @classmethod
    def from_config(cls, cfg: TrainerConfig, timeout_s: float, stop: Callable[[], bool] = lambda: False):
        r = cfg.run
        for key in ("service_url", "service_cert", "service_token_file"):
            if not getattr(r, key):
                raise ConfigError(f"run.{key}: required when diloco.mode is 'async'")
        return cls(r.service_url, cert=r.service_cert, token_file=r.service_token_file,
                   timeout_s=timeout_s, retry_s=r.service_retry_s, stop=stop)

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kw):
        """One request, retried on transport errors and 5xx until retry_s is spent."""
        import httpx

        from trainer.loop import Preempted

        deadline = time.monotonic() + self.retry_s
        tries = 0
        while True:
            try:
                resp = self._http.request(method, path, **kw)
                if resp.status_code < 500:
                    break
                why = f"HTTP {resp.status_code}"
            except httpx.TransportError as e:
                why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if self.stop():
                raise Preempted()
            wait = RETRY_BACKOFF_S[min(tries, len(RETRY_BACKOFF_S) - 1)]
            tries += 1
            if time.monotonic() + wait > deadline:
                raise ServiceUnavailable(f"outer service {self.url} unreachable after {tries} tries "
                                         f"over {self.retry_s:.0f}s: {why}")
            time.sleep(wait)
        if resp.status_code >= 400:
            try:
                msg = resp.json().get("error", resp.text)
            except ValueError:
                msg = resp.text
            raise ServiceRefused(f"outer service {method} {path}: HTTP {resp.status_code}: {msg}")
        return resp

    def health(self) -> dict:
        return self._call("GET", "/healthz").json()

    def state(self) -> dict:
        return self._call("GET", "/state").json()

    def init(self, params: Sequence[torch.Tensor], site: str = "") -> tuple[bool, int]:
        """Join as `site` and offer θ_0; (whether θ_0 was taken, bytes sent)."""
        body = flat_bytes(params)
        shapes = json.dumps([list(p.shape) for p in params])
        resp = self._call("POST", "/init", content=body, headers={"X-Shapes": shapes, "X-Site": site})
        return bool(resp.json()["initialized"]), len(body)

    def wait_joined(self, sites: int, timeout_s: float, poll_s: float = 0.05) -> int:
        """Wait until `sites` sites joined (or timeout_s passed); returns how many did."""
        deadline = time.monotonic() + timeout_s
        while True:
            n = len(self.state()["joined"])
            if n >= sites or time.monotonic() > deadline:
                return n
            if self.stop():
                from trainer.loop import Preempted

                raise Preempted()
            time.sleep(poll_s)

    def pull(self, shapes: Sequence[tuple[int, ...]]) -> tuple[int, list[torch.Tensor], int]:
        """(version, θ, bytes received)."""
        resp = self._call("GET", "/params")
        return int(resp.headers["X-Version"]), from_flat(resp.content, shapes), len(resp.content)

    def push(self, site: str, base_version: int, codec: str, phases: Sequence[bytes]) -> tuple[dict, int]:
        """Send one encoded Δ computed from θ at `base_version`; (the service's answer, bytes sent)."""
        body = b"".join(phases)
        resp = self._call("POST", "/push", content=body, headers={
            "X-Site": site, "X-Base-Version": str(base_version), "X-Codec": codec,
            "Content-Type": "application/octet-stream"})
        return resp.json(), len(body)


def _broadcast_obj(obj, world: int):
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _broadcast_params(run: SiteRun, theta: list[torch.Tensor] | None) -> list[torch.Tensor]:
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
def _adopt(run: SiteRun, theta: list[torch.Tensor]) -> None:
    """θ becomes the base of the next round and the site's parameters."""
    for g, t in zip(run.outer.params, theta, strict=True):
        g.copy_(t)
    run.outer.copy_to(run.site.params)


def run_async(run: SiteRun) -> int:
    """The site's loop in async mode (SiteRun.run dispatches here); returns the exit code."""
    from trainer.loop import EXIT_OK

    cfg = run.cfg
    d = cfg.diloco
    leader = run.rank == 0
    shapes = [tuple(p.shape) for p in run.outer.params]
    client = ServiceClient.from_config(cfg, run.timeout.total_seconds(), stop=lambda: run.stop_requested) \
        if leader else None
    try:
        # join: the first site's θ_0 seeds the service; everyone then starts from its current θ.
        # A fresh run waits (up to run.startup_wait_s) for all sites, so that no site trains alone
        # while another is still importing torch; a restarted site goes straight on.
        version, theta, joined = 0, None, 1
        if leader:
            assert client is not None
            client.init(run.outer.params, cfg.run.site)  # θ_0 is taken only if no site seeded it yet
            if run.resumed_from is None and cfg.run.resume_round < 0 and d.sites > 1:
                joined = client.wait_joined(d.sites, cfg.run.startup_wait_s)
            version, theta, _ = client.pull(shapes)
        version = _broadcast_obj(version if leader else None, run.world)
        _adopt(run, _broadcast_params(run, theta))
        if run.h_done:  # resumed mid-round: that partial round was based on a θ the service moved past
            run.h_done = 0
        joined = _broadcast_obj(joined if leader else None, run.world)
        run.metrics.event("quorum", f"joined the outer service at version {version} ({joined} of {d.sites} "
                          f"sites there)", round=run.round, k_active=joined, version=version,
                          service=cfg.run.service_url)
        while run.round < d.rounds:
            h = run.h
            compute_s, losses = run.compute(h)
            t0 = time.perf_counter()
            deltas = run.outer.deltas(run.site.params)
            res, theta = None, None
            if leader:
                assert client is not None
                phases, _ = encode_delta(run.comp, deltas)
                try:
                    ans, sent = client.push(cfg.run.site, version, d.compression, phases)
                    res = {"committed": True, "staleness": int(ans["staleness"]), "scale": float(ans["scale"]),
                           "lr": float(ans["lr"]), "bytes_sent": sent}
                except ServiceRefused as e:
                    if "HTTP 401" in str(e) or "HTTP 400" in str(e):
                        raise  # a wrong token or a codec mismatch does not heal by itself
                    # 409: the service restarted behind our base version; this Δ is lost, pull and go on
                    run.metrics.event("error", f"push refused, round not applied: {e}", round=run.round + 1)
                    res = {"committed": False, "staleness": 0, "scale": 0.0, "lr": 0.0, "bytes_sent": 0}
                version, theta, recv = client.pull(shapes)
                res["bytes_recv"], res["version"] = recv, version
            res = _broadcast_obj(res, run.world)
            version = res["version"]
            _adopt(run, _broadcast_params(run, theta))
            sync_s = time.perf_counter() - t0
            run.round += 1
            run.h_done = 0
            val = None
            if (cfg.train.eval_every and run.round % cfg.train.eval_every == 0) or run.round == d.rounds:
                val = run.site.evaluate(run.vbatches)
            run.metrics.write(RoundRecord(
                round=run.round, step=run.site.step, h=h, compute_s=compute_s, sync_s=sync_s,
                bytes_sent=res["bytes_sent"], bytes_recv=res["bytes_recv"], k_active=1 if res["committed"] else 0,
                k_nominal=d.sites, outer_lr=res["lr"] * res["scale"], committed=res["committed"],
                train_loss=sum(losses) / len(losses) if losses else None, val_loss=val,
                val_ppl=math.exp(val) if val is not None else None, tokens=run.site.tokens * run.site.dp,
                staleness=res["staleness"]))
            if cfg.checkpoint.every_rounds and run.round % cfg.checkpoint.every_rounds == 0:
                run.save()
    finally:
        if client is not None:
            client.close()
    run.ckpt.wait()
    return EXIT_OK
