"""A mutual-TLS TCP relay: a service that speaks plaintext (torchft's Lighthouse) reachable only by
holders of a certificate of the run.

    service host:  Lighthouse on 127.0.0.1:29510  <-  RelayServer(public :29511, target 127.0.0.1:29510)
    each site:     Manager -> 127.0.0.1:29512 = RelayClient(server host:29511, expect its site name)

The server relays a connection only after the TLS 1.3 handshake proved a certificate of the run's
CA (and, when `allowed` is given, one of those site names); the client relays only to a server
whose certificate names the expected site. Bytes are copied as they come, both ways.

`dilococtl launch` runs the server side as its own process beside a Lighthouse bound to loopback
(`python -m trainer.transport.relay --bind HOST:PORT --target 127.0.0.1:PORT --site NAME --cert ...`);
each trainer runs the client side in-process (trainer.ft.make_manager). The server shows the
identity of the site whose host runs the Lighthouse (or the run's "lighthouse" identity when that
host is in no site: dilococtl.spec.lighthouse_site), and admits only the run's sites.
"""

from __future__ import annotations

import argparse
import logging
import selectors
import socket
import ssl
import threading

from trainer.signals import wait_for_stop
from trainer.transport.tls import (
    Identity,
    TransportError,
    check_peer,
    client_context,
    peer_site,
    server_context,
    tune_socket,
)

log = logging.getLogger(__name__)

HANDSHAKE_S = 10.0  # longest a TLS handshake may take
_BUF = 1 << 16
_CAP = 1 << 20  # bytes buffered per direction before the relay stops reading that direction's source


def _splice(plain: socket.socket, tls: ssl.SSLSocket) -> None:
    """Copy both ways until either side ends (what it sent before is still delivered), then close both.

    One thread does every operation on the TLS connection (OpenSSL forbids using one connection
    from two threads at once), with non-blocking sockets and a bounded buffer per direction: a
    blocking write in one direction could otherwise wait on the other direction forever.
    """
    plain.setblocking(False)
    tls.setblocking(False)
    peer = {plain: tls, tls: plain}
    out: dict = {plain: bytearray(), tls: bytearray()}  # bytes waiting to be written to each side
    ended = False  # a side reached its end: deliver what is pending, then stop
    sel = selectors.DefaultSelector()

    def want(sock: socket.socket, ev: int) -> None:
        key = sel.get_map().get(sock)
        if not ev:
            if key is not None:
                sel.unregister(sock)
        elif key is None:
            sel.register(sock, ev)
        elif key.events != ev:
            sel.modify(sock, ev)

    try:
        while not (ended and not out[plain] and not out[tls]):
            for sock in (plain, tls):
                ev = selectors.EVENT_WRITE if out[sock] else 0
                if not ended and len(out[peer[sock]]) < _CAP:
                    ev |= selectors.EVENT_READ
                want(sock, ev)
            ready = sel.select(timeout=1.0)
            events = {key.fileobj: mask for key, mask in ready}
            if tls.pending() and not ended:
                events[tls] = events.get(tls, 0) | selectors.EVENT_READ
            for sock, mask in events.items():
                if mask & selectors.EVENT_READ and not ended and len(out[peer[sock]]) < _CAP:
                    try:
                        data = sock.recv(_BUF)
                    except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                        data = None
                    if data == b"":
                        ended = True
                    elif data:
                        out[peer[sock]] += data
                if mask & selectors.EVENT_WRITE and out[sock]:
                    try:
                        n = sock.send(out[sock])
                    except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                        n = 0
                    del out[sock][:n]
    except OSError:
        pass
    finally:
        sel.close()
        plain.close()
        tls.close()


class _Relay:
    def __init__(self, bind: str, port: int):
        self.sock = socket.create_server((bind, port), backlog=128)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0  # connections relayed
        self.refused = 0  # connections refused (no certificate of the run, wrong site)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name=f"relay-{self.port}")
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                raw, addr = self.sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._handle, args=(raw, addr), daemon=True, name="relay-conn").start()

    def _handle(self, raw: socket.socket, addr) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Stop accepting (connections already relayed run to their end)."""
        self._closed.set()
        try:
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._thread.join(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RelayServer(_Relay):
    """Public TLS side in front of a plaintext `target` that listens on loopback only."""

    def __init__(self, identity: Identity, *, target: tuple[str, int], bind: str = "0.0.0.0", port: int = 0,
                 allowed: set[str] | None = None):
        self.ctx = server_context(identity)
        self.target = target
        self.allowed = allowed
        super().__init__(bind, port)

    def _handle(self, raw: socket.socket, addr) -> None:
        try:
            raw.settimeout(HANDSHAKE_S)
            tune_socket(raw)
            tls = self.ctx.wrap_socket(raw, server_side=True)
            site = check_peer(tls, self.allowed) if self.allowed is not None else peer_site(tls)
        except (OSError, ssl.SSLError, TransportError) as e:
            self.refused += 1
            log.warning("relay %d refused %s: %s", self.port, addr[0], e)
            raw.close()
            return
        try:
            up = socket.create_connection(self.target, timeout=HANDSHAKE_S)
            tune_socket(up)  # both legs: a relayed request split in two must not wait out a delayed ACK
        except OSError as e:
            log.warning("relay %d: target %s:%d unreachable: %s", self.port, *self.target, e)
            tls.close()
            return
        self.accepted += 1
        log.info("relay %d: site %s from %s", self.port, site, addr[0])
        tls.settimeout(None)
        up.settimeout(None)
        _splice(up, tls)


class RelayClient(_Relay):
    """Loopback plaintext side: each local connection goes to `server` over TLS, which must be `expect`."""

    def __init__(self, identity: Identity, *, server: tuple[str, int], expect: str, port: int = 0):
        self.ctx = client_context(identity)
        self.server = server
        self.expect = expect
        super().__init__("127.0.0.1", port)

    def _handle(self, raw: socket.socket, addr) -> None:
        try:
            tune_socket(raw)
            up = socket.create_connection(self.server, timeout=HANDSHAKE_S)
            tune_socket(up)
            tls = self.ctx.wrap_socket(up)
            check_peer(tls, self.expect)
        except (OSError, ssl.SSLError, TransportError) as e:
            self.refused += 1
            log.warning("relay %d: server %s:%d refused or unverified: %s", self.port, *self.server, e)
            raw.close()
            return
        self.accepted += 1
        tls.settimeout(None)
        raw.settimeout(None)
        _splice(raw, tls)


def _hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def main(argv: list[str] | None = None) -> int:
    """`python -m trainer.transport.relay --bind HOST:PORT --target HOST:PORT --site NAME --cert C --key K
    --ca CA [--allow a,b]`: a RelayServer until SIGTERM."""
    ap = argparse.ArgumentParser(prog="python -m trainer.transport.relay")
    ap.add_argument("--bind", type=_hostport, required=True, help="public HOST:PORT the sites dial")
    ap.add_argument("--target", type=_hostport, required=True, help="the plaintext service, on loopback")
    ap.add_argument("--site", required=True, help="the name this relay's certificate names")
    ap.add_argument("--cert", required=True, help="its PEM certificate, signed by the run's CA")
    ap.add_argument("--key", required=True, help="its PEM private key (mode 0600)")
    ap.add_argument("--ca", required=True, help="the run's CA certificate: the only one trusted")
    ap.add_argument("--allow", default="", help="comma-separated site names admitted (empty: any of the run)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    ident = Identity(site=args.site, cert=args.cert, key=args.key, ca=args.ca)
    allowed = {s for s in args.allow.split(",") if s} or None
    try:
        server = RelayServer(ident, target=args.target, bind=args.bind[0], port=args.bind[1], allowed=allowed)
    except (OSError, ssl.SSLError, TransportError) as e:
        print(f"relay: cannot listen on {args.bind[0]}:{args.bind[1]}: {e}", flush=True)
        return 1
    print(f"relay listening on {args.bind[0]}:{server.port} for {args.target[0]}:{args.target[1]} "
          f"as {args.site}", flush=True)
    wait_for_stop()
    server.close()
    return 0


__all__ = ["RelayClient", "RelayServer", "main"]


if __name__ == "__main__":
    raise SystemExit(main())
