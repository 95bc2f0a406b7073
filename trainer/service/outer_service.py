"""The outer parameter service of async mode: owns θ and the outer optimizer, applies stale pushes.

`python -m trainer.service.outer_service --bind HOST:PORT --cert C --key K --token-file T --state-dir D --config TOML`

This module is the process and its HTTP/TLS face; trainer.service.param_service holds θ and the push logic.

The config is the same trainer TOML the sites run with, so the service cannot disagree with them
on the outer optimizer, the codec and its options, or the dampening.

Each site runs at its own pace (trainer.modes.async_mode): it pulls θ at version τ, runs H inner steps,
pushes its pseudo-gradient Δ (encoded with the run's codec) naming τ, and pulls again. The
service applies a push at its current version t as one site's share of an outer step:

    γ = t − τ,  ψ(γ) = 1 / (1 + α γ)  ("inverse") or 1 / sqrt(1 + γ)  ("sqrt")
    torch SGD(Nesterov) step with gradient ψ(γ)·Δ and lr = effective_lr(cfg, k_active=1)

so with elastic_lr each push moves θ by 1/K of a synchronous round (η·1/K); the dampening scales
the gradient, not the lr, so stale pushes do not shrink the momentum other sites built up.
Every applied push makes version t+1. θ_0 is set by the first site's POST /init (all sites
start from the same seed), so the service needs no model code.

HTTP over TLS (http.server.ThreadingHTTPServer, the handshake done in the request's thread; at most
MAX_PREAUTH connections not yet authenticated at once, each dropped when silent HANDSHAKE_TIMEOUT_S
or, over the cap, when it is the oldest; a slow trickle thus cannot hold a place):
  GET  /healthz   no auth: {"ok", "version", "initialized"}
  GET  /params    θ as concatenated little-endian fp32; headers X-Version, X-Shapes (JSON)
  POST /init      θ_0 (same layout; headers X-Shapes, X-Site); a no-op once initialized; the site
                  counts as joined. X-Shapes and Content-Length are checked before any body byte is
                  read: other shapes than θ's (409), more than INIT_MAX_BYTES before θ exists (413)
  POST /push      headers X-Site, X-Base-Version, X-Codec, X-Push-Id (unique per push: a replayed
                  id is refused); body = the codec's phase buffers in order
                  -> {"version", "staleness", "scale", "lr", "clip"}; with X-Want-Params: 1, θ as
                  this push left it (as /params), that answer in header X-Push: one round trip
                  per async round instead of push + pull, and the site starts from its own push.
                  A site pushes once per version (X-Base-Version at least the version its last push
                  made, else 409); its Δ is clipped by the other sites' norms and an absolute cap
                  (trainer.service.param_service)
  GET  /state     {"version", "pushes", "joined", "per_site", "staleness_sum", "staleness_max", ...}
Everything but /healthz needs `Authorization: Bearer TOKEN` (the token file's content); the token
is compared in constant time and never logged. With `--client-ca` (launch always passes the run's
CA) every client must present a certificate of the run: its common name is the site a push or
join counts for, and an X-Site header naming another site is refused (403). The state is saved every
`diloco.async_checkpoint_every` versions (and on SIGTERM) as a signed round directory in --state-dir
(trainer.service.param_service) and loaded back at start. When the config names object stores ([checkpoint]
store, replica_stores) each round is uploaded there in the background under the run's id as site
"_outer_service", `checkpoint.keep` rounds kept; on SIGTERM the last upload gets UPLOAD_GRACE_S. A start
with no newer verified round on disk than in the stores restores the stored one first (every machine
lost). The signing key is the run's checkpoint key ($DILOCO_CHECKPOINT_KEY, a path; launch sets it).
"""

from __future__ import annotations

import argparse
import hmac
import json
import math
import os
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from trainer.checkpoints.checkpoint_trust import CheckpointKeyError
from trainer.checkpoints.snapshot_store import StoreError, checkpoint_stores
from trainer.outer.optimizer import DAMPENINGS, dampening  # noqa: F401 (re-exported)
from trainer.rules import config as config_mod
from trainer.rules.outer_rule import async_alpha
from trainer.service.param_service import (  # noqa: F401 (re-exported: the service's clients and tests)
    OuterService,
    PushResult,
    ServiceError,
    encode_delta,
    flat_bytes,
    from_flat,
    split_phases,
)
from trainer.service.signals import wait_for_stop

HANDSHAKE_TIMEOUT_S = 10.0  # a connection not yet authenticated (TLS handshake, and without
# --client-ca its first request's token) that stays silent this long is dropped
MAX_PREAUTH = 32  # connections at most in that unauthenticated stage at once (each holds a thread)
PREAUTH_GRACE_S = 1.0  # over MAX_PREAUTH, the oldest such connection is dropped if it waited longer
# than this (an honest handshake takes a few round trips), else the new one is closed at once
INIT_MAX_BYTES = 1 << 34  # POST /init before θ exists: the most θ_0 may declare (16 GiB, 4e9 fp32 values)
IO_TIMEOUT_S = 300.0  # one request's reads and writes (large θ on slow links)
DRAIN_LIMIT = 1 << 20  # a refused request's body is read (and dropped) up to this size
UPLOAD_GRACE_S = 5.0  # on SIGTERM, the last round's upload may take this long: the control plane's SIGKILL
# comes 10 s after its SIGTERM when a run ends (dilococtl.coordinators.end_lighthouse); a cut upload leaves
# the stores their previous rounds (its manifest goes last)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _TLSServer

    def log_message(self, format: str, *args) -> None:  # request line only: never headers (the token)
        if os.environ.get("OUTER_SERVICE_ACCESS_LOG"):
            super().log_message(format, *args)

    def _reply(self, status: int, body: bytes, ctype: str = "application/json", headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj: dict) -> None:
        self._reply(status, json.dumps(obj).encode())

    def _site(self) -> str:
        """Who sent this request: the certificate's site when clients present one, else X-Site."""
        said = self.headers.get("X-Site", "")
        if not self.server.mutual:
            return said
        site = peer_site(self.connection)
        if said and said != site:
            raise ServiceError(403, f"X-Site {said!r} is not the site of this connection's certificate")
        return site

    def _authorized(self) -> bool:
        got = self.headers.get("Authorization", "")
        want = f"Bearer {self.server.token}"
        if hmac.compare_digest(got.encode(), want.encode()):
            self.server.authenticated(self.connection)
            return True
        self._refuse(401, "missing or wrong bearer token")
        return False

    def _refuse(self, status: int, message: str) -> None:
        if not self._consumed:  # an unread body would be parsed as the next request
            self._discard_body()
        self._json(status, {"error": message})

    def _discard_body(self) -> None:
        """Read a small refused body so that closing does not reset the connection under the reply;
        a large one is not read: the connection closes (the client may then see a reset)."""
        try:
            n = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            n = -1
        if 0 <= n <= DRAIN_LIMIT:
            self.rfile.read(n)
        else:
            self.close_connection = True

    def _body(self, limit: int, exact: bool = False) -> bytes:
        """The body, once its declared length is checked against `limit` (`exact`: equal to it)."""
        try:
            n = int(self.headers.get("Content-Length", "-1"))
        except ValueError:
            n = -1
        if n < 0:
            raise ServiceError(411, "Content-Length required")
        if n > limit or (exact and n != limit):
            self.close_connection = True
            raise ServiceError(413 if n > limit else 400, f"body of {n} bytes; {limit} expected")
        self._consumed = True
        return self.rfile.read(n)

    def _init_shapes(self, svc: OuterService) -> list[tuple[int, ...]]:
        """X-Shapes of a POST /init, checked before any body byte is read: once θ exists they must
        be θ's shapes (409), before that their size at most INIT_MAX_BYTES (413)."""
        raw = json.loads(self.headers.get("X-Shapes", "null"))
        if not isinstance(raw, list) or not all(isinstance(s, list) and all(type(x) is int and x >= 0 for x in s)
                                                for s in raw):
            raise ServiceError(400, "X-Shapes: a JSON list of shapes (lists of non-negative integers) required")
        shapes = [tuple(s) for s in raw]
        if svc.shapes is not None and shapes != svc.shapes:
            self.close_connection = True
            raise ServiceError(409, f"θ has {len(svc.shapes)} parameters of other shapes than the {len(shapes)} "
                                    f"declared; is this the same model? (body not read)")
        if 4 * sum(math.prod(s) for s in shapes) > INIT_MAX_BYTES:
            self.close_connection = True
            raise ServiceError(413, f"X-Shapes declares more than {INIT_MAX_BYTES} bytes of θ_0 (body not read)")
        return shapes

    def _dispatch(self, method: str) -> None:
        svc = self.server.service
        path = self.path.split("?", 1)[0]
        self._consumed = False
        try:
            if method == "GET" and path == "/healthz":
                return self._json(200, {"ok": True, "version": svc.version, "initialized": svc.initialized})
            if (method, path) not in (("GET", "/params"), ("GET", "/state"), ("POST", "/init"), ("POST", "/push")):
                return self._refuse(404, f"no route {method} {path}")
            if not self._authorized():
                return None
            if path == "/state":
                return self._json(200, svc.state())
            if path == "/params":
                version, data = svc.params()
                return self._reply(200, data, "application/octet-stream",
                                   {"X-Version": str(version), "X-Shapes": json.dumps(svc.shapes)})
            if path == "/init":
                shapes = self._init_shapes(svc)
                body = self._body(4 * sum(math.prod(s) for s in shapes), exact=True)
                fresh = svc.init(from_flat(body, shapes), self._site())
                return self._json(200, {"version": svc.version, "initialized": fresh})
            # /push
            if svc.shapes is None:
                raise ServiceError(409, "not initialized: no site has sent θ_0 yet")
            site = self._site()
            base = int(self.headers.get("X-Base-Version", "-1"))
            codec = self.headers.get("X-Codec")
            push_id = self.headers.get("X-Push-Id", "")
            if not 16 <= len(push_id) <= 64 or not push_id.isalnum():
                raise ServiceError(400, "X-Push-Id: 16-64 letters or digits required (replay protection)")
            plan = svc.decoder.plan  # planned once, from θ's shapes and the run's codec options
            phases = split_phases(self._body(plan.payload_bytes), plan)
            want = self.headers.get("X-Want-Params", "") == "1"
            res = svc.push(site, base, phases, codec, push_id=push_id, with_params=want)
            answer = {"version": res.version, "staleness": res.staleness, "scale": res.scale, "lr": res.lr,
                      "clip": res.clip}
            if res.params is not None:
                return self._reply(200, res.params, "application/octet-stream",
                                   {"X-Version": str(res.version), "X-Push": json.dumps(answer)})
            return self._json(200, answer)
        except ServiceError as e:
            return self._refuse(e.status, str(e))
        except (ValueError, TypeError) as e:  # malformed headers or bodies
            return self._refuse(400, f"bad request: {e}")

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")


class _PreauthGate:
    """Bounds the connections not yet authenticated, each of which holds a thread (issue 34, 11).

    Over `cap`, the oldest one is dropped if it has waited longer than `grace` (idle connections do
    not lock honest clients out), else the new one is refused: a flood of fresh connections costs
    the service no thread. A dropped connection is shut down, which wakes its thread's read.
    """

    def __init__(self, cap: int, grace: float):
        self.cap, self.grace = cap, grace
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[float, socket.socket]] = {}  # id(sock) -> (since, sock)

    def admit(self, sock: socket.socket) -> bool:
        now = time.monotonic()
        with self._lock:
            if len(self._pending) >= self.cap:
                key, (since, old) = min(self._pending.items(), key=lambda kv: kv[1][0])
                if now - since <= self.grace:
                    return False
                del self._pending[key]
                try:  # the base class's shutdown: an SSLSocket's own would drop its TLS state under its thread
                    socket.socket.shutdown(old, socket.SHUT_RDWR)
                except OSError:
                    pass
            self._pending[id(sock)] = (now, sock)
            return True

    def wrap(self, sock: socket.socket, wrap: Callable[[socket.socket], ssl.SSLSocket]) -> ssl.SSLSocket:
        """wrap(sock), which takes over its file descriptor, tracked in its place; under the lock, so
        a drop never finds the old object with its descriptor gone."""
        with self._lock:
            entry = self._pending.pop(id(sock), None)
            new = wrap(sock)
            if entry is not None:
                self._pending[id(new)] = (entry[0], new)
            return new

    def release(self, sock: socket.socket) -> None:
        with self._lock:
            self._pending.pop(id(sock), None)

    def __len__(self) -> int:
        return len(self._pending)


class _TLSServer(ThreadingHTTPServer):
    """ThreadingHTTPServer that speaks TLS only; the handshake runs in the request's own thread,
    so a client that connects and stays silent cannot stall the accept loop. At most MAX_PREAUTH
    connections are unauthenticated at once (_PreauthGate), each silent at most HANDSHAKE_TIMEOUT_S:
    with --client-ca the handshake authenticates (the run's certificate), else the first request's token."""

    daemon_threads = True
    request_queue_size = 128  # listen backlog: socketserver's 5 makes a burst of connects wait on SYN retries

    def __init__(self, addr, service: OuterService, ssl_ctx: ssl.SSLContext, token: str, mutual: bool = False,
                 max_preauth: int = MAX_PREAUTH):
        self.service = service
        self.ssl_ctx = ssl_ctx
        self.token = token
        self.mutual = mutual  # clients are known by their certificate (the run's CA signed it)
        self.gate = _PreauthGate(max_preauth, PREAUTH_GRACE_S)
        super().__init__(addr, _Handler)

    def process_request(self, request, client_address) -> None:
        if not self.gate.admit(request):
            self.shutdown_request(request)  # over the cap: closed at once, no thread started
            return
        super().process_request(request, client_address)

    def authenticated(self, conn: socket.socket) -> None:
        """`conn` proved it belongs to the run: it leaves the gate and gets the request timeout."""
        self.gate.release(conn)
        conn.settimeout(IO_TIMEOUT_S)

    def finish_request(self, request, client_address) -> None:
        request.settimeout(HANDSHAKE_TIMEOUT_S)
        try:  # no I/O yet: the handshake runs below, under the timeout
            tls = self.gate.wrap(request, lambda s: self.ssl_ctx.wrap_socket(s, server_side=True,
                                                                             do_handshake_on_connect=False))
        except (ssl.SSLError, OSError):
            self.gate.release(request)
            return
        try:
            tls.do_handshake()
            if self.mutual:  # the client's certificate is the run's: authenticated
                self.authenticated(tls)
            self.RequestHandlerClass(tls, client_address, self)
        except (ssl.SSLError, OSError):
            return  # not TLS, a client that does not trust our certificate, too slow, or dropped by the gate
        finally:
            self.gate.release(tls)
            try:
                tls.close()
            except OSError:
                pass


def read_token(path: str | Path) -> str:
    """The shared token in `path` (stripped); ValueError naming the file when missing or empty."""
    p = Path(path)
    try:
        token = p.read_text().strip()
    except OSError as e:
        raise ValueError(f"token file {p}: {e.strerror or e}") from None
    if not token:
        raise ValueError(f"token file {p} is empty")
    return token


def make_server(service: OuterService, host: str, port: int, *, cert: str | Path, key: str | Path,
                token: str, client_ca: str | Path | None = None, max_preauth: int = MAX_PREAUTH) -> _TLSServer:
    """A TLS HTTP server for `service` bound to host:port (port 0: any free port).

    `client_ca`: the run's CA; every client must then present a certificate it signed, and the
    certificate's common name is the site a request comes from (X-Site may only repeat it).
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(cert), str(key))
    if client_ca:
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=str(client_ca))
    return _TLSServer((host, port), service, ctx, token, mutual=bool(client_ca), max_preauth=max_preauth)


def peer_site(tls: ssl.SSLSocket) -> str:
    """The common name of the certificate the peer presented ("" when none)."""
    cert = tls.getpeercert() or {}
    for rdn in cert.get("subject", ()):
        for name, value in rdn:
            if name == "commonName":
                return value
    return ""


def _split_bind(bind: str) -> tuple[str, int]:
    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--bind: expected HOST:PORT, got {bind!r}")
    return host.strip("[]"), int(port)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.service.outer_service", description=__doc__.splitlines()[0])
    ap.add_argument("--bind", required=True, help="HOST:PORT to listen on")
    ap.add_argument("--cert", required=True, help="PEM certificate the sites pin")
    ap.add_argument("--key", required=True, help="its PEM private key")
    ap.add_argument("--token-file", required=True, help="file holding the shared bearer token")
    ap.add_argument("--state-dir", default="", help="service checkpoints (loaded back at start)")
    ap.add_argument("--client-ca", default="",
                    help="the run's CA: sites must present a certificate it signed, which names them")
    ap.add_argument("--config", required=True,
                    help="the run's trainer TOML: its [diloco] table (outer optimizer, codec and its options, "
                         "dampening, sites, async_checkpoint_every) is what the sites run with")
    args = ap.parse_args(argv)
    try:
        host, port = _split_bind(args.bind)
        token = read_token(args.token_file)
        full = config_mod.load(args.config)
        cfg = full.diloco
        if cfg.mode != "async":
            raise ValueError(f"{args.config}: diloco.mode is {cfg.mode!r}; the outer service serves async runs")
        stores = checkpoint_stores(full) if args.state_dir else []  # a round goes up from its local copy
        service = OuterService(cfg, state_dir=args.state_dir or None, checkpoint_every=cfg.async_checkpoint_every,
                               train=full.train,  # the sites' AdamW sets the absolute cap on a push
                               stores=stores, store_keep=full.checkpoint.keep)
        server = make_server(service, host, port, cert=args.cert, key=args.key, token=token,
                             client_ca=args.client_ca or None)
    except (ValueError, OSError, ssl.SSLError, CheckpointKeyError, StoreError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    resumed = f", resumed at version {service.version} from {service.loaded_from}" if service.loaded_from else ""
    print(f"outer service listening on https://{args.bind} (codec {cfg.compression}, "
          f"dampening {cfg.async_dampening} α={async_alpha(cfg):g}){resumed}", flush=True)
    thread = threading.Thread(target=server.serve_forever, name="outer-service", daemon=True)
    thread.start()
    wait_for_stop()
    server.shutdown()
    saved = service.save()
    service.close(UPLOAD_GRACE_S)  # the last round's upload, if any: the stores then hold this version
    print(f"outer service stopped at version {service.version}" + (f"; saved {saved}" if saved else ""), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
