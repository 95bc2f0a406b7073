"""The client of the async mode's outer parameter service (trainer.service.outer_service): httpx over TLS."""

from __future__ import annotations

import json
import secrets
import ssl
import time
from collections.abc import Callable, Sequence

import torch

from trainer.modes.exchange import Preempted
from trainer.rules.config import TrainerConfig
from trainer.rules.tables import ConfigError
from trainer.service.outer_service import flat_bytes, from_flat, read_token

RETRY_BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)  # waits between tries; the last one repeats
UNREACHABLE_AFTER_TRIES = 3  # this many failed tries in a row (3.5 s of waits) make a coordinator_unreachable event


class ServiceUnavailable(RuntimeError):
    """The outer service did not answer within run.service_retry_s."""


class ServiceRefused(RuntimeError):
    """The outer service answered with an error that retrying cannot fix (bad token, bad push)."""


class ServiceClient:
    """httpx client of the outer service: TLS pinned to the run's certificate, bearer token auth."""

    def __init__(self, url: str, *, cert: str, token_file: str, timeout_s: float = 60.0,
                 retry_s: float = 60.0, stop: Callable[[], bool] = lambda: False,
                 identity: tuple[str, str] | None = None):
        """`identity`: (certificate, key) of this site, signed by the run's CA, presented to the service."""
        import httpx

        if not url.startswith("https://"):
            raise ConfigError(f"run.service_url: must be an https:// URL, got {url!r}")
        try:
            ctx = ssl.create_default_context(cafile=cert)  # the run's certificate is the only anchor
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"run.service_cert: cannot load {cert!r}: {e}") from None
        if identity is not None:
            try:
                ctx.load_cert_chain(*identity)
            except (OSError, ssl.SSLError) as e:
                raise ConfigError(f"run.tls_cert/tls_key: cannot load {identity[0]!r}: {e}") from None
        try:
            token = read_token(token_file)
        except ValueError as e:
            raise ConfigError(f"run.service_token_file: {e}") from None
        self.url = url.rstrip("/")
        self.retry_s = retry_s
        # on_event(kind, message, **detail): a service that stops answering is reported (issue 41), once per
        # outage, as `coordinator_unreachable` (with since when) and `coordinator_back`
        self.on_event: Callable[..., None] | None = None
        self._down_since: float | None = None  # wall time of the first failed try of a reported outage
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
                   timeout_s=timeout_s, retry_s=r.service_retry_s, stop=stop,
                   identity=(r.tls_cert, r.tls_key) if r.tls_cert and r.tls_key else None)

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kw):
        """One request, retried on transport errors and 5xx until retry_s is spent."""
        import httpx

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
            if tries == 1:
                first_fail = time.time()
            if tries == UNREACHABLE_AFTER_TRIES and self._down_since is None and self.on_event is not None:
                self._down_since = first_fail
                self.on_event("coordinator_unreachable", f"cannot reach the outer service ({why}) since "
                              f"{time.strftime('%H:%M:%S', time.gmtime(first_fail))} UTC", since=first_fail, why=why)
            if time.monotonic() + wait > deadline:
                raise ServiceUnavailable(f"outer service {self.url} unreachable after {tries} tries "
                                         f"over {self.retry_s:.0f}s: {why}")
            time.sleep(wait)
        if self._down_since is not None and self.on_event is not None:
            self.on_event("coordinator_back", f"the outer service answers again after "
                          f"{time.time() - self._down_since:.0f} s", since=self._down_since,
                          seconds=round(time.time() - self._down_since, 1))
            self._down_since = None
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
                raise Preempted()
            time.sleep(poll_s)

    def pull(self, shapes: Sequence[tuple[int, ...]]) -> tuple[int, list[torch.Tensor], int]:
        """(version, θ, bytes received)."""
        resp = self._call("GET", "/params")
        return int(resp.headers["X-Version"]), from_flat(resp.content, shapes), len(resp.content)

    def _post_push(self, site: str, base_version: int, codec: str, phases: Sequence[bytes], **headers: str):
        body = b"".join(phases)
        # one id per push, kept across retries: a retry of a push the service did apply is refused
        resp = self._call("POST", "/push", content=body, headers={
            "X-Site": site, "X-Base-Version": str(base_version), "X-Codec": codec, "X-Push-Id": secrets.token_hex(16),
            "Content-Type": "application/octet-stream", **headers})
        return resp, len(body)

    def push(self, site: str, base_version: int, codec: str, phases: Sequence[bytes]) -> tuple[dict, int]:
        """Send one encoded Δ computed from θ at `base_version`; (the service's answer, bytes sent)."""
        resp, sent = self._post_push(site, base_version, codec, phases)
        return resp.json(), sent

    def push_pull(self, site: str, base_version: int, codec: str, phases: Sequence[bytes],
                  shapes: Sequence[tuple[int, ...]]) -> tuple[dict, int, list[torch.Tensor], int]:
        """Push, and get back θ as that push left it, in one round trip.

        (the service's answer (its "version" is θ's), bytes sent, θ, bytes received).
        """
        resp, sent = self._post_push(site, base_version, codec, phases, **{"X-Want-Params": "1"})
        return json.loads(resp.headers["X-Push"]), sent, from_flat(resp.content, shapes), len(resp.content)
