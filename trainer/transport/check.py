"""A real handshake of the cross-site transport between two nodes, before a run (for `doctor`).

    python -m trainer.transport.check listen --ca CA --cert CRT --key KEY --site S --port P --expect PEER [--wait-s 30]
    python -m trainer.transport.check dial   --ca CA --cert CRT --key KEY --site S --addr HOST:PORT --expect PEER

`listen` accepts connections until one proves to be site PEER (mutual TLS 1.3 under the run's CA,
as the mesh does), answers it, and exits 0; `dial` connects to a listener, checks that it is site
PEER, and prints the handshake time. Either prints one JSON line; a refusal or timeout exits 1
with the reason (for example a certificate from another CA, or for another site).
"""

from __future__ import annotations

import argparse
import json
import socket
import ssl
import sys
import time

from trainer.transport.tls import (
    Identity,
    TransportError,
    check_peer,
    client_context,
    server_context,
    tune_socket,
)

PING = b"dilococtl-transport-check\n"


def listen(ident: Identity, *, port: int, expect: str, wait_s: float, bind: str = "0.0.0.0",
           ready=None) -> dict:
    """Serve until site `expect` completes a handshake (or wait_s passes); what happened."""
    ctx = server_context(ident)
    refused: list[str] = []
    deadline = time.monotonic() + wait_s
    with socket.create_server((bind, port)) as ls:
        if ready is not None:
            ready(ls.getsockname()[1])
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportError(f"no handshake from site {expect} within {wait_s:g} s"
                                     + (f" (refused: {'; '.join(refused)})" if refused else ""))
            ls.settimeout(left)
            try:
                raw, addr = ls.accept()
            except TimeoutError:
                continue
            raw.settimeout(min(10.0, max(0.01, left)))
            try:
                with ctx.wrap_socket(raw, server_side=True) as s:
                    site = check_peer(s, expect)
                    s.sendall(PING)
                    return {"ok": True, "peer": site, "from": addr[0]}
            except (OSError, ssl.SSLError, TransportError) as e:
                refused.append(f"{addr[0]}: {e}")
                raw.close()


def dial(ident: Identity, *, host: str, port: int, expect: str, timeout_s: float = 10.0) -> dict:
    """One handshake with the listener at host:port, which must be site `expect`; its time."""
    ctx = client_context(ident)
    t0 = time.perf_counter()
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw:
            tune_socket(raw)
            with ctx.wrap_socket(raw) as s:
                site = check_peer(s, expect)
                handshake_s = time.perf_counter() - t0
                got = s.recv(len(PING))
    except (OSError, ssl.SSLError) as e:
        raise TransportError(f"handshake with {host}:{port} failed: {e}") from None
    if got != PING:
        raise TransportError(f"{host}:{port} completed the handshake but did not answer")
    return {"ok": True, "peer": site, "handshake_s": round(handshake_s, 4), "tls": "TLSv1.3"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.transport.check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["listen", "dial"])
    for name in ("ca", "cert", "key", "site", "expect"):
        p.add_argument(f"--{name}", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--addr", default="", help="dial: HOST:PORT of the listener")
    p.add_argument("--wait-s", type=float, default=30.0)
    a = p.parse_args(argv)
    ident = Identity(site=a.site, cert=a.cert, key=a.key, ca=a.ca)
    try:
        if a.mode == "listen":
            out = listen(ident, port=a.port, expect=a.expect, wait_s=a.wait_s,
                         ready=lambda port: print(json.dumps({"listening": port}), flush=True))
        else:
            host, _, port = a.addr.rpartition(":")
            if not host or not port.isdigit():
                print(json.dumps({"ok": False, "error": f"--addr must be HOST:PORT, got {a.addr!r}"}))
                return 2
            out = dial(ident, host=host.strip("[]"), port=int(port), expect=a.expect)
    except (TransportError, OSError) as e:
        print(json.dumps({"ok": False, "error": str(e)}))
        return 1
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
