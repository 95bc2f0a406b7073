"""A mutual-TLS TCP relay: a service that speaks plaintext (torchft's Lighthouse) reachable only by
holders of a certificate of the run.

    service host:  Lighthouse on 127.0.0.1:29510  <-  RelayServer(public :29511, target 127.0.0.1:29510)
    each site:     Manager -> 127.0.0.1:29512 = RelayClient(server host:29511, expect its site name)

The server relays a connection only after the TLS 1.3 handshake proved a certificate of the run's
CA (and, when `allowed` is given, one of those site names); the client relays only to a server
whose certificate names the expected site. Bytes are copied as they come, both ways.

`dilococtl launch` runs the server side as its own process beside a Lighthouse bound to loopback
(`python -m trainer.transport.relay --bind HOST:PORT --target 127.0.0.1:PORT --site NAME --cert ...`);
each trainer runs the client side in-process (trainer.modes.ft.make_manager). The server shows the
identity of the site whose host runs the Lighthouse (or the run's "lighthouse" identity when that
host is in no site: dilococtl.spec_sites.lighthouse_site), and admits only the run's sites.
"""

from __future__ import annotations

import argparse
import logging
import os
import selectors
import socket
import ssl
import struct
import threading

from trainer.service.signals import wait_for_stop
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
PREAUTH_MAX = 32  # connections a relay proves at once (TLS handshake, uid check); a flood cannot pile up threads
_BUF = 1 << 16
_CAP = 1 << 20  # bytes buffered per direction before the relay stops reading that direction's source


def _splice(plain: socket.socket, tls: socket.socket) -> None:
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
            if isinstance(tls, ssl.SSLSocket) and tls.pending() and not ended:
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


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of `sock`, None when it cannot be told.

    A Unix socket says it itself (SO_PEERCRED). For loopback TCP the kernel knows which uid made
    the peer's socket: /proc/net/tcp{,6} lists it beside the connection's two ends (the identd way).
    """
    if sock.family == socket.AF_UNIX:
        _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              struct.calcsize("3i")))
        return uid
    try:
        peer, me = sock.getpeername()[:2], sock.getsockname()[:2]
    except OSError:
        return None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 7 and _proc_addr(cols[1]) == peer and _proc_addr(cols[2]) == me:
                return int(cols[7])
    return None


def _proc_addr(text: str) -> tuple[str, int]:
    """/proc/net/tcp's "0100007F:1F90" as ("127.0.0.1", 8080): the address in 32-bit words of host order.
    An IPv4-mapped IPv6 address reads as the IPv4 one, as getpeername() gives it on an IPv4 socket."""
    addr, port = text.split(":")
    raw = b"".join(struct.pack("=I", int(addr[i:i + 8], 16)) for i in range(0, len(addr), 8))
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw), int(port, 16)
    if raw[:12] == b"\0" * 10 + b"\xff\xff":
        return socket.inet_ntop(socket.AF_INET, raw[12:]), int(port, 16)
    return socket.inet_ntop(socket.AF_INET6, raw), int(port, 16)


def open_target(target: tuple[str, int] | str, timeout: float = HANDSHAKE_S) -> socket.socket:
    """A connection to the plaintext service: `(host, port)` over TCP, or a path: the Lighthouse's door
    (trainer.service.lighthouse), a Unix socket that hands back a connection made inside its private network."""
    if not isinstance(target, str):
        return socket.create_connection(target, timeout=timeout)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as door:
        door.settimeout(timeout)
        door.connect(target)
        _msg, fds, _flags, _addr = socket.recv_fds(door, 1, 1)
    if not fds:
        raise OSError(f"the door {target} handed back no connection")
    conn = socket.socket(fileno=fds[0])
    conn.settimeout(timeout)
    return conn


def _target_text(target: tuple[str, int] | str) -> str:
    return f"unix:{target}" if isinstance(target, str) else f"{target[0]}:{target[1]}"


class _Relay:
    """A listening socket whose connections are each proved, then relayed, in a thread of their own.

    At most `preauth_max` connections are being proved at once: when one more arrives, the one that
    has waited longest is cut first (it has had the most time to prove itself), so a flood of silent
    connections holds neither unbounded threads nor the door shut to a peer that answers promptly.
    """

    def __init__(self, bind: str, port: int, preauth_max: int = PREAUTH_MAX):
        self.sock = socket.create_server((bind, port), backlog=128)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0  # connections relayed
        self.refused = 0  # connections refused (no certificate of the run, wrong site, another uid)
        self.cut = 0  # connections cut before they proved themselves (over the cap, or out of time)
        self.preauth_max = preauth_max
        self._slots = threading.BoundedSemaphore(preauth_max)
        # accepted connection -> the socket its proof runs on now (wrapping takes over the descriptor); oldest first
        self._proving: dict[socket.socket, socket.socket] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name=f"relay-{self.port}")
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                raw, addr = self.sock.accept()
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                self._cut_oldest()
                if not self._slots.acquire(timeout=HANDSHAKE_S):  # the cut one's thread ends at once
                    self.cut += 1
                    raw.close()
                    continue
            with self._lock:
                self._proving[raw] = raw
            threading.Thread(target=self._run, args=(raw, addr), daemon=True, name="relay-conn").start()

    def _cut_oldest(self) -> None:
        with self._lock:
            if not self._proving:
                return
            now = self._proving.pop(next(iter(self._proving)))
            try:
                socket.socket.shutdown(now, socket.SHUT_RDWR)  # its thread's blocking call returns at once
            except OSError:
                pass  # not wrapped yet or closed: its thread finds it cut (_track)
        self.cut += 1
        if self.cut & (self.cut - 1) == 0:  # 1, 2, 4, ...: a flood is logged, not echoed line by line
            log.warning("relay %d: %d connections cut before proving themselves (more than %d at once)",
                        self.port, self.cut, self.preauth_max)

    def _track(self, raw: socket.socket, now: socket.socket) -> bool:
        """The proof of `raw` goes on on `now` (a wrapped socket, which took over the descriptor);
        False if it was cut meanwhile (then `now` is closed)."""
        with self._lock:
            if raw in self._proving:
                self._proving[raw] = now
                return True
        now.close()
        return False

    def _run(self, raw: socket.socket, addr) -> None:
        done = threading.Event()

        def proved() -> None:  # the connection leaves the pre-authentication pool (once)
            if not done.is_set():
                done.set()
                with self._lock:
                    self._proving.pop(raw, None)
                self._slots.release()

        try:
            self._handle(raw, addr, proved)
        finally:
            proved()

    def _handle(self, raw: socket.socket, addr, proved) -> None:
        raise NotImplementedError

    def _same_uid(self, raw: socket.socket, addr) -> bool:
        """Whether the local process at the other end runs as this one's uid (refused and logged if not)."""
        uid = peer_uid(raw)
        if uid == os.getuid():
            return True
        self.refused += 1
        who = "an unknown uid" if uid is None else f"uid {uid}"
        log.warning("relay %d refused a local connection from %s (port %s): only uid %d may use it",
                    self.port, who, addr[1] if addr else "?", os.getuid())
        raw.close()
        return False

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
    """Public TLS side in front of a plaintext `target` that only the run can reach: a loopback
    (host, port), or the path of the Lighthouse's door (trainer.service.lighthouse)."""

    def __init__(self, identity: Identity, *, target: tuple[str, int] | str, bind: str = "0.0.0.0",
                 port: int = 0, allowed: set[str] | None = None, preauth_max: int = PREAUTH_MAX):
        self.ctx = server_context(identity)
        self.target = target
        self.allowed = allowed
        super().__init__(bind, port, preauth_max)

    def _handle(self, raw: socket.socket, addr, proved) -> None:
        try:
            raw.settimeout(HANDSHAKE_S)
            tune_socket(raw)
            tls = self.ctx.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
            if not self._track(raw, tls):
                return
            tls.do_handshake()
            site = check_peer(tls, self.allowed) if self.allowed is not None else peer_site(tls)
        except (OSError, ssl.SSLError, TransportError) as e:
            self.refused += 1
            log.warning("relay %d refused %s: %s", self.port, addr[0], e)
            raw.close()
            return
        proved()
        try:
            up = open_target(self.target)
            _tune(up)  # both legs: a relayed request split in two must not wait out a delayed ACK
        except OSError as e:
            log.warning("relay %d: target %s unreachable: %s", self.port, _target_text(self.target), e)
            tls.close()
            return
        self.accepted += 1
        log.info("relay %d: site %s from %s", self.port, site, addr[0])
        tls.settimeout(None)
        up.settimeout(None)
        _splice(up, tls)


class LocalRelay(_Relay):
    """Loopback plaintext side of the Lighthouse's host: the sites led from that host dial it directly
    (run.lighthouse_loopback), without TLS; only processes of this uid are let through to `target`."""

    def __init__(self, *, target: tuple[str, int] | str, port: int = 0, preauth_max: int = PREAUTH_MAX):
        self.target = target
        super().__init__("127.0.0.1", port, preauth_max)

    def _handle(self, raw: socket.socket, addr, proved) -> None:
        if not self._same_uid(raw, addr):
            return
        proved()
        try:
            up = open_target(self.target)
            _tune(up)
            tune_socket(raw)
        except OSError as e:
            log.warning("relay %d: target %s unreachable: %s", self.port, _target_text(self.target), e)
            raw.close()
            return
        self.accepted += 1
        up.settimeout(None)
        raw.settimeout(None)
        _splice(raw, up)


class RelayClient(_Relay):
    """Loopback plaintext side: each local connection of this uid goes to `server` over TLS, which must
    be `expect`. Another local user's connection is refused at accept: it would speak with this site's
    certificate (join the quorum, reach the Lighthouse's kill endpoint)."""

    def __init__(self, identity: Identity, *, server: tuple[str, int], expect: str, port: int = 0,
                 preauth_max: int = PREAUTH_MAX):
        self.ctx = client_context(identity)
        self.server = server
        self.expect = expect
        super().__init__("127.0.0.1", port, preauth_max)

    def _handle(self, raw: socket.socket, addr, proved) -> None:
        if not self._same_uid(raw, addr):
            return
        try:
            tune_socket(raw)
            up = socket.create_connection(self.server, timeout=HANDSHAKE_S)
            tune_socket(up)
            tls = self.ctx.wrap_socket(up, do_handshake_on_connect=False)
            if not self._track(raw, tls):
                raw.close()
                return
            tls.do_handshake()
            check_peer(tls, self.expect)
        except (OSError, ssl.SSLError, TransportError) as e:
            self.refused += 1
            log.warning("relay %d: server %s:%d refused or unverified: %s", self.port, *self.server, e)
            raw.close()
            return
        proved()
        self.accepted += 1
        tls.settimeout(None)
        raw.settimeout(None)
        _splice(raw, tls)


def _tune(sock: socket.socket) -> None:
    if sock.family != socket.AF_UNIX:
        tune_socket(sock)


def _hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def _target(text: str) -> tuple[str, int] | str:
    """HOST:PORT, or unix:PATH (the Lighthouse's door)."""
    if text.startswith("unix:"):
        if not text[5:].startswith("/"):
            raise argparse.ArgumentTypeError(f"expected unix:/ABSOLUTE/PATH, got {text!r}")
        return text[5:]
    return _hostport(text)


def main(argv: list[str] | None = None) -> int:
    """`python -m trainer.transport.relay --bind HOST:PORT --target HOST:PORT|unix:PATH --site NAME --cert C
    --key K --ca CA [--allow a,b] [--local]`: a RelayServer (and a LocalRelay) until SIGTERM."""
    ap = argparse.ArgumentParser(prog="python -m trainer.transport.relay")
    ap.add_argument("--bind", type=_hostport, required=True, help="public HOST:PORT the sites dial")
    ap.add_argument("--target", type=_target, required=True,
                    help="the plaintext service: HOST:PORT on loopback, or unix:PATH of the Lighthouse's door")
    ap.add_argument("--site", required=True, help="the name this relay's certificate names")
    ap.add_argument("--cert", required=True, help="its PEM certificate, signed by the run's CA")
    ap.add_argument("--key", required=True, help="its PEM private key (mode 0600)")
    ap.add_argument("--ca", required=True, help="the run's CA certificate: the only one trusted")
    ap.add_argument("--allow", default="", help="comma-separated site names admitted (empty: any of the run)")
    ap.add_argument("--local", action="store_true",
                    help="also a loopback port for this host's own sites, open to this uid only (LocalRelay)")
    ap.add_argument("--local-port", type=int, default=0,
                    help="the --local port (0: any free one); a restarted relay takes its old one again, "
                         "which the sites on this host dial")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    ident = Identity(site=args.site, cert=args.cert, key=args.key, ca=args.ca)
    allowed = {s for s in args.allow.split(",") if s} or None
    try:
        server = RelayServer(ident, target=args.target, bind=args.bind[0], port=args.bind[1], allowed=allowed)
        local = LocalRelay(target=args.target, port=args.local_port) if args.local else None
    except (OSError, ssl.SSLError, TransportError) as e:
        print(f"relay: cannot listen on {args.bind[0]}:{args.bind[1]}: {e}", flush=True)
        return 1
    extra = f"; local 127.0.0.1:{local.port}" if local is not None else ""
    print(f"relay listening on {args.bind[0]}:{server.port} for {_target_text(args.target)} "
          f"as {args.site}{extra}", flush=True)
    wait_for_stop()
    server.close()
    if local is not None:
        local.close()
    return 0


__all__ = ["LocalRelay", "RelayClient", "RelayServer", "main", "open_target", "peer_uid"]


if __name__ == "__main__":
    raise SystemExit(main())
