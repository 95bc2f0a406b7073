"""The connections of one group: S mutually authenticated TLS streams between every pair of members.

Every member keeps one listening socket for its whole life (`Listener`); a group is built once
per quorum (`build_mesh`): the higher rank of each pair dials the lower one S times, both ends
verify the other's certificate against the run's CA and the expected site name, then exchange a
hello naming the session (unique per quorum), the ranks, the stream index and the group's shape.
A connection that fails any of this is closed before anything else is read from it, and does not
count; the build keeps waiting for the right peer until its deadline.

A stream whose two ends are both loopback addresses (two sites on one host, as in the demo) may
leave TLS after the hello, when both members' listeners allow it (`clear_loopback`): both ends
send close_notify and the same TCP connection then carries chunks in the clear. The peer was
authenticated all the same, and loopback bytes never leave the kernel: reading or injecting them
takes root on the host, as the in-site path's (gloo, NCCL) does. The cipher is most of the
transport's cost there (BENCHMARKS.md, "Loopback").
"""

from __future__ import annotations

import logging
import queue
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field

from trainer.transport.tls import (
    Identity,
    PeerRefused,
    TransportError,
    check_peer,
    client_context,
    on_loopback,
    server_context,
    tune_socket,
)
from trainer.transport.wire import HELLO, MAGIC_HELLO, VERSION, PeerLost, recv_bytes, send_all

log = logging.getLogger(__name__)

HANDSHAKE_S = 10.0  # longest a single TLS handshake + hello may take (a silent stranger is dropped)
PREAUTH_MAX = 32  # accepted connections authenticated at once in a build; one more cuts the longest waiting


class Listener:
    """The member's listening socket; bound once, reused by every quorum's mesh."""

    def __init__(self, identity: Identity, host: str = "0.0.0.0", port: int = 0, clear_loopback: bool = False):
        self.identity = identity
        self.clear_loopback = clear_loopback  # streams between two loopback ends leave TLS after the hello
        self.server_ctx = server_context(identity)
        self.client_ctx = client_context(identity)
        self.sock = socket.create_server((host, port), backlog=256)
        self.port = self.sock.getsockname()[1]
        self.refused = 0  # connections refused so far (bad certificate, wrong site or session)
        self.cut = 0  # connections cut before they proved themselves (more than PREAUTH_MAX at once)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(kw_only=True, slots=True)
class Mesh:
    """Between two members, 2S connections each carrying one direction only: stream s < S from the
    dialer (higher rank) to the listener, S + s back. One thread per end ever reads or writes a
    given TLS connection (OpenSSL forbids concurrent use of one connection)."""

    rank: int
    size: int
    streams: int  # S: connections per direction per peer
    links: dict[int, list[ssl.SSLSocket]] = field(default_factory=dict)  # peer -> its 2S connections
    clear_streams: dict[int, int] = field(default_factory=dict)  # peer -> how many of them left TLS (loopback)

    def tx(self, peer: int, s: int) -> ssl.SSLSocket:
        """The connection this member sends on to `peer`, stream s."""
        return self.links[peer][s if self.rank > peer else self.streams + s]

    def rx(self, peer: int, s: int) -> ssl.SSLSocket:
        """The connection this member receives on from `peer`, stream s."""
        return self.links[peer][self.streams + s if self.rank > peer else s]

    def add(self, peer: int, stream: int, sock: ssl.SSLSocket, clear: bool) -> None:
        """Stream `stream` to `peer` is open (`clear`: it left TLS)."""
        self.links[peer][stream] = sock
        self.clear_streams[peer] = self.clear_streams.get(peer, 0) + clear

    def lanes(self, peer: int) -> int:
        """Streams a collective stripes over to and from `peer`: all S, or 1 where every stream of the
        pair is a clear loopback one (no window to fill there: more streams only add thread hand-offs).
        Both members of the pair agreed on each stream, so both count the same."""
        return 1 if self.clear_streams.get(peer, 0) == 2 * self.streams else self.streams

    def all_sockets(self) -> list[ssl.SSLSocket]:
        return [s for socks in self.links.values() for s in socks]

    def abort(self) -> None:
        """Unblock every thread reading or writing a stream of this mesh (the streams stay open)."""
        for s in self.all_sockets():
            try:
                socket.socket.shutdown(s, socket.SHUT_RDWR)  # not SSLSocket.shutdown: another thread may be in SSL_read
            except OSError:
                pass

    def close(self) -> None:
        for s in self.all_sockets():
            try:
                s.close()
            except OSError:
                pass
        self.links.clear()


def _hello(session: bytes, frm: int, to: int, stream: int, streams: int, size: int, clear: bool = False) -> bytes:
    return HELLO.pack(MAGIC_HELLO, VERSION, session, frm, to, stream, streams, size, int(clear))


def _wants_clear(listener: Listener, sock: socket.socket) -> bool:
    return listener.clear_loopback and on_loopback(sock)


def _leave_tls(s: ssl.SSLSocket, clear: bool) -> ssl.SSLSocket:
    """After an agreed hello: the stream in the clear (close_notify both ways), or still in TLS."""
    if not clear:
        return s
    try:
        return s.unwrap()
    except (OSError, ssl.SSLError) as e:
        s.close()
        raise PeerLost(f"leaving TLS on a loopback stream failed: {e}") from None


def _dial(listener: Listener, addr: tuple[str, int], site: str, hello_for, deadline: float,
          timeout_s: float, stop: threading.Event) -> tuple[ssl.SSLSocket, bool]:
    """One authenticated stream to the member at `addr`, and whether it left TLS; retried until `deadline`."""
    delay = 0.05
    while True:
        if stop.is_set():
            raise TransportError("mesh build abandoned")
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransportError(f"could not open a stream to site {site} at {addr[0]}:{addr[1]} in time")
        raw = None
        try:
            raw = socket.create_connection(addr, timeout=min(left, HANDSHAKE_S))
            tune_socket(raw)
            s = listener.client_ctx.wrap_socket(raw, server_hostname=None)
            raw = None
            want = _wants_clear(listener, s)
            hello = hello_for(want)
            try:
                check_peer(s, site)
                send_all(s, hello)
                ack = recv_bytes(s, HELLO.size)
            except BaseException:
                s.close()
                raise
            if ack[:-1] != _ack(hello)[:-1] or ack[-1] > 1:
                s.close()
                raise PeerRefused(f"site {site} answered another session or group")
            clear = want and ack[-1] == 1
            s = _leave_tls(s, clear)
            s.settimeout(timeout_s)
            return s, clear
        except PeerRefused:
            raise  # a listener that is not the expected site: retrying cannot help
        except (OSError, PeerLost) as e:  # not listening yet, or busy: retry until the deadline
            if raw is not None:
                raw.close()
            log.debug("dial %s %s: %s", site, addr, e)
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 1.0)


def _ack(hello: bytes, clear: bool | None = None) -> bytes:
    """The answer to `hello`: the same fields, ranks swapped, and the answerer's own clear flag."""
    magic, ver, session, frm, to, stream, streams, size, flag = HELLO.unpack(hello)
    return HELLO.pack(magic, ver, session, to, frm, stream, streams, size, flag if clear is None else int(clear))


def _handshake(listener: Listener, s: ssl.SSLSocket, peer_addr, expected: dict[int, str], session: bytes,
               rank: int, streams: int, size: int, deadline: float,
               timeout_s: float) -> tuple[int, int, ssl.SSLSocket, bool] | None:
    """Authenticate one accepted connection (`s`: wrapped, not yet shaken hands); (peer rank, stream,
    socket, whether it left TLS) if it proves itself, None if refused."""
    try:
        s.do_handshake()
    except (OSError, ssl.SSLError) as e:
        s.close()
        listener.refused += 1
        log.warning("refused a connection from %s: TLS handshake failed (%s)", peer_addr, e)
        return None
    try:
        site = check_peer(s, set(expected.values()))  # before anything is read from it
        hello = recv_bytes(s, HELLO.size)
        magic, ver, sess, frm, to, stream, s_count, g_size, flag = HELLO.unpack(hello)
        if magic == MAGIC_HELLO and ver != VERSION:
            raise PeerRefused(f"site {site} speaks transport version {ver}, this one {VERSION}: every site must "
                              f"run the same trainer")
        if magic != MAGIC_HELLO or sess != session:
            raise PeerRefused(f"site {site} dialed another session (a stale or foreign quorum)")
        if to != rank or frm not in expected or (s_count, g_size) != (streams, size) or stream >= 2 * streams:
            raise PeerRefused(f"site {site} sent a hello for rank {to} from {frm}, {s_count} streams, "
                              f"group of {g_size}; expected rank {rank}, {streams} streams, group of {size}")
        if expected[frm] != site:
            raise PeerRefused(f"site {site} claims rank {frm}, which is site {expected[frm]}")
        if flag > 1:
            raise PeerRefused(f"site {site} sent a hello with clear flag {flag}")
        want = _wants_clear(listener, s)
        send_all(s, _ack(hello, want))
        clear = want and flag == 1
        s = _leave_tls(s, clear)
    except (PeerRefused, PeerLost, OSError) as e:
        s.close()
        listener.refused += 1
        log.warning("refused a connection from %s: %s", peer_addr, e)
        return None
    s.settimeout(timeout_s)
    return frm, stream, s, clear


def build_mesh(listener: Listener, *, rank: int, size: int, sites: list[str], addrs: list[tuple[str, int]],
               streams: int, session: bytes, timeout_s: float) -> Mesh:
    """Open 2S connections to every other member (sites[i] listens at addrs[i]); all within timeout_s.

    `session` (16 bytes) must be the same at every member of this group and new for each group,
    so no stream of an earlier quorum can be mistaken for one of this quorum.
    """
    if len(sites) != size or len(addrs) != size or not 0 <= rank < size:
        raise ValueError(f"mesh: rank {rank} of {size} with {len(sites)} sites and {len(addrs)} addresses")
    if not 1 <= streams <= 1024:
        raise ValueError(f"mesh: streams must be in [1, 1024], got {streams}")
    if len(session) != 16:
        raise ValueError("mesh: the session id is 16 bytes")
    if sites[rank] != listener.identity.site:
        raise ValueError(f"mesh: rank {rank} is site {sites[rank]}, but this member's certificate is for "
                         f"{listener.identity.site}")
    mesh = Mesh(rank=rank, size=size, streams=streams)
    deadline = time.monotonic() + timeout_s
    for p in range(size):
        if p != rank:
            mesh.links[p] = [None] * (2 * streams)  # type: ignore[list-item]
    errors: list[BaseException] = []
    stop = threading.Event()

    def dial_all() -> None:
        try:
            for p in range(rank):
                for st in range(2 * streams):
                    hello_for = lambda clear, p=p, st=st: _hello(session, rank, p, st, streams, size, clear)  # noqa: E731
                    mesh.add(p, st, *_dial(listener, addrs[p], sites[p], hello_for, deadline, timeout_s, stop))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            errors.append(e)

    dialer = threading.Thread(target=dial_all, name=f"dlt-dial-r{rank}", daemon=True)
    dialer.start()
    # each accepted connection is authenticated in a thread of its own: a stranger that stalls its
    # handshake holds up only itself, not the members queued behind it
    done: queue.Queue = queue.Queue()
    pending: dict[threading.Thread, ssl.SSLSocket] = {}
    try:
        expected = {p: sites[p] for p in range(rank + 1, size)}
        missing = 2 * streams * len(expected)
        while missing and not errors:
            while True:  # what the handshakes have finished
                try:
                    got = done.get_nowait()
                except queue.Empty:
                    break
                if got is None:
                    continue
                frm, st, s, clear = got
                if mesh.links[frm][st] is not None:  # a duplicate: keep the first
                    s.close()
                    continue
                mesh.add(frm, st, s, clear)
                missing -= 1
            if not missing:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportError(f"rank {rank}: {missing} streams from sites "
                                     f"{', '.join(sorted(set(expected.values())))} did not arrive in time")
            listener.sock.settimeout(min(left, 0.05))
            try:
                raw, peer_addr = listener.sock.accept()
            except TimeoutError:
                continue
            try:
                raw.settimeout(min(HANDSHAKE_S, max(0.01, deadline - time.monotonic())))
                tune_socket(raw)
                # wrapped here, shaken in the thread: the build can cut a handshake that outlives it
                tls = listener.server_ctx.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
            except (OSError, ssl.SSLError):
                raw.close()
                continue
            for t in [t for t in pending if not t.is_alive()]:
                del pending[t]
            if len(pending) >= PREAUTH_MAX:
                _cut_oldest(listener, pending)
            th = threading.Thread(target=lambda tls=tls, peer_addr=peer_addr: done.put(_handshake(
                listener, tls, peer_addr, expected, session, rank, streams, size, deadline, timeout_s)),
                name=f"dlt-accept-r{rank}", daemon=True)
            pending[th] = tls
            th.start()
        dialer.join(max(0.0, deadline - time.monotonic()) + HANDSHAKE_S)
        if errors:
            raise errors[0]
        if dialer.is_alive():
            raise TransportError(f"rank {rank}: dialing the lower ranks did not finish in time")
    except BaseException:
        stop.set()
        dialer.join(HANDSHAKE_S + 1.0)  # before closing: it may still add a stream
        _end_handshakes(pending, done)
        for socks in mesh.links.values():
            for s in socks:
                if s is not None:
                    s.close()
        raise
    _end_handshakes(pending, done)  # strangers still shaking hands, or duplicates: not this mesh's
    return mesh


def _cut_oldest(listener: Listener, pending: dict[threading.Thread, ssl.SSLSocket]) -> None:
    """Make room for one more handshake: cut the one waiting longest (it had the most time to prove
    itself), so a flood of silent connections holds neither unbounded threads nor the build's door
    shut to a member that answers promptly. Its thread ends at once (its SSL call fails); it is
    waited for, so the threads stay within PREAUTH_MAX."""
    th, tls = next(iter(pending.items()))  # insertion order: the oldest first
    del pending[th]
    listener.cut += 1
    if listener.cut & (listener.cut - 1) == 0:  # 1, 2, 4, ...: a flood is logged, not echoed line by line
        log.warning("%d connections cut before proving themselves (more than %d at once)", listener.cut, PREAUTH_MAX)
    try:
        socket.socket.shutdown(tls, socket.SHUT_RDWR)
    except OSError:
        pass
    th.join(1.0)


def _end_handshakes(pending: dict[threading.Thread, ssl.SSLSocket], done: queue.Queue) -> None:
    """Cut the handshakes still running, wait for their threads, close what they let in."""
    for th, tls in pending.items():
        if th.is_alive():
            try:
                socket.socket.shutdown(tls, socket.SHUT_RDWR)  # the thread's SSL call ends at once
            except OSError:
                pass
    for th in pending:
        th.join(HANDSHAKE_S)
    while True:
        try:
            got = done.get_nowait()
        except queue.Empty:
            return
        if got is not None:
            got[2].close()
