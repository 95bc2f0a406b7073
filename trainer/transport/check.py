"""A real handshake of the cross-site transport between two nodes, before a run (for `doctor`).

    python -m trainer.transport.check listen --ca CA --cert CRT --key KEY --site S --port P --expect PEER[,PEER...]
                                             [--wait-s 30] [--port-file PATH] [--stop-file PATH]
    python -m trainer.transport.check dial   --ca CA --cert CRT --key KEY --site S --addr HOST:PORT --expect PEER
                                             [--timeout-s 10]

`listen` accepts connections until every PEER has proved to be that site (mutual TLS 1.3 under
the run's CA, as the mesh does), answers each, and exits 0; with --port 0 it listens on a port
the kernel picks, as the transport does, and --port-file receives that port. `dial` connects to a
listener, checks that it is site PEER, and prints the handshake time. Either prints one JSON
line; a refusal or timeout exits 1 with the reason, and `dial` names its kind in "reason"
(`REASONS`: refused, timeout, wrong CA, wrong site, tls).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import ssl
import sys
import time

from trainer.transport.tls import (
    Identity,
    PeerRefused,
    TransportError,
    check_peer,
    client_context,
    server_context,
    tune_socket,
)

PING = b"dilococtl-transport-check\n"
REASONS = ("refused", "timeout", "wrong CA", "wrong site", "tls")  # what `dial` calls a failure


class HandshakeFailed(TransportError):
    """`dial` failed; `reason` is one of REASONS."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def listen(ident: Identity, *, port: int, expect: str | list[str], wait_s: float, bind: str = "0.0.0.0",
           ready=None, stop=None) -> dict:
    """Serve until every site of `expect` completed a handshake (or wait_s passes, or `stop()` says
    so: its caller knows no one else will come); what happened."""
    want = [expect] if isinstance(expect, str) else list(expect)
    ctx = server_context(ident)
    refused: list[str] = []
    done: dict[str, str] = {}  # site -> the address it came from
    deadline = time.monotonic() + wait_s
    with socket.create_server((bind, port)) as ls:
        if ready is not None:
            ready(ls.getsockname()[1])
        while True:
            left = deadline - time.monotonic()
            stopped = stop is not None and stop()
            if left <= 0 or stopped:
                missing = [w for w in want if w not in done]
                raise TransportError(f"no handshake from site {', '.join(missing)} "
                                     + ("before it was stopped" if stopped else f"within {wait_s:g} s")
                                     + (f" (refused: {'; '.join(refused)})" if refused else ""))
            ls.settimeout(min(left, 0.25) if stop is not None else left)
            try:
                raw, addr = ls.accept()
            except TimeoutError:
                continue
            raw.settimeout(min(10.0, max(0.01, left)))
            try:
                with ctx.wrap_socket(raw, server_side=True) as s:
                    site = check_peer(s, {w for w in want if w not in done})
                    s.sendall(PING)
                    done[site] = addr[0]
            except (OSError, ssl.SSLError, TransportError) as e:
                refused.append(f"{addr[0]}: {e}")
                raw.close()
            if len(done) == len(want):
                return {"ok": True, "peer": site, "peers": sorted(done), "from": done[site]}


def _reason(e: BaseException) -> str:
    """The kind of a dial failure (REASONS)."""
    if isinstance(e, ConnectionRefusedError):
        return "refused"
    if isinstance(e, TimeoutError):  # socket.timeout too: connect, handshake or answer
        return "timeout"
    if isinstance(e, ssl.SSLCertVerificationError):
        return "wrong CA"  # the listener's certificate is not from this run's CA
    text = str(e).lower()
    if "unknown ca" in text or "certificate unknown" in text or "bad certificate" in text:
        return "wrong CA"  # the listener did not accept ours
    return "tls"


def dial(ident: Identity, *, host: str, port: int, expect: str, timeout_s: float = 10.0) -> dict:
    """One handshake with the listener at host:port, which must be site `expect`; its time.
    HandshakeFailed names why not."""
    ctx = client_context(ident)
    t0 = time.perf_counter()
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw:
            tune_socket(raw)
            with ctx.wrap_socket(raw) as s:
                site = check_peer(s, expect)
                handshake_s = time.perf_counter() - t0
                got = s.recv(len(PING))  # TLS 1.3: a listener refusing our certificate says so here
    except PeerRefused as e:
        raise HandshakeFailed("wrong site", f"handshake with {host}:{port} failed: {e}") from None
    except (OSError, ssl.SSLError) as e:
        raise HandshakeFailed(_reason(e), f"handshake with {host}:{port} failed: {e}") from None
    if got != PING:
        raise HandshakeFailed("tls", f"{host}:{port} completed the handshake but did not answer")
    return {"ok": True, "peer": site, "handshake_s": round(handshake_s, 4), "tls": "TLSv1.3"}


def _write_port(path: str, port: int) -> None:
    tmp = f"{path}.part"
    with open(tmp, "w") as f:
        f.write(f"{port}\n")
    os.replace(tmp, path)  # a reader never sees half a number


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.transport.check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["listen", "dial"])
    for name in ("ca", "cert", "key", "site", "expect"):
        p.add_argument(f"--{name}", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--addr", default="", help="dial: HOST:PORT of the listener")
    p.add_argument("--wait-s", type=float, default=30.0, help="listen: give up after this long")
    p.add_argument("--bind", default="0.0.0.0", help="listen: address to listen on")
    p.add_argument("--port-file", default="", help="listen: write the port listened on here")
    p.add_argument("--stop-file", default="", help="listen: give up as soon as this file exists")
    p.add_argument("--timeout-s", type=float, default=10.0, help="dial: connect, handshake and answer within this")
    a = p.parse_args(argv)
    ident = Identity(site=a.site, cert=a.cert, key=a.key, ca=a.ca)

    def ready(port: int) -> None:
        if a.port_file:
            _write_port(a.port_file, port)
        print(json.dumps({"listening": port}), flush=True)

    try:
        if a.mode == "listen":
            out = listen(ident, port=a.port, expect=[x for x in a.expect.split(",") if x], wait_s=a.wait_s,
                         bind=a.bind, ready=ready,
                         stop=(lambda: os.path.exists(a.stop_file)) if a.stop_file else None)
        else:
            host, _, port = a.addr.rpartition(":")
            if not host or not port.isdigit():
                print(json.dumps({"ok": False, "error": f"--addr must be HOST:PORT, got {a.addr!r}"}))
                return 2
            out = dial(ident, host=host.strip("[]"), port=int(port), expect=a.expect, timeout_s=a.timeout_s)
    except HandshakeFailed as e:
        print(json.dumps({"ok": False, "reason": e.reason, "error": str(e)}))
        return 1
    except (TransportError, OSError) as e:
        print(json.dumps({"ok": False, "error": str(e)}))
        return 1
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
