"""`TlsComm`: the `trainer.collectives.Comm` collectives over a mesh of TLS streams.

A tensor is cut into chunks dealt round S streams (a ring's steps in one sequence), so S
connections per peer carry one collective at once: a link whose round trip holds more than one
TCP window needs several windows in flight (PCCL keeps many connections per peer for the same reason).

- allreduce_sum: a ring. The buffer is cut into K blocks; in K-1 reduce-scatter steps each member
  passes a block to its right neighbour, which adds its own values; in K-1 all-gather steps the
  reduced blocks go round unchanged. Pipelined per chunk: a chunk is forwarded as soon as it has
  arrived and been added, not when its whole step is done. Each member sends 2(K-1)/K of the
  buffer. Block b is summed in ring order (x_{b+1} + x_{b+2}) + ... + x_b at every run, and every
  member ends with the bytes of that one sum: results are bit-identical everywhere.
- allgather: the all-gather half of the ring over K blocks, one per member ((K-1) x n sent).
- alltoall: part j sent straight to member j on the pair's S streams.

Every collective runs its jobs (one per stream and direction) on worker threads the comm keeps
for its life and joins when it is closed; it returns when every job has ended. Every read and
write has the timeout, and the collective as a whole too: past it the streams are shut, the
jobs end, and the call raises. A comm whose collective failed stays failed: the next quorum
builds a new mesh.
"""

from __future__ import annotations

import math
import queue
import socket
import threading
import time
from collections.abc import Callable

import torch
from torch import Tensor

from trainer.rules.chunk_rule import CHUNK_BYTES, MIN_CHUNK_BYTES, chunk_elems
from trainer.transport import tcp_cc
from trainer.transport.mesh import Mesh
from trainer.transport.tls import TransportError
from trainer.transport.wire import (
    HEADER,
    OP_ALLGATHER,
    OP_ALLREDUCE,
    OP_ALLTOALL,
    OP_BLOB,
    PeerLost,
    check_header,
    dtype_code,
    pack_header,
    recv_bytes,
    recv_exact,
    send_all,
)

_POLL_S = 0.2  # how often a waiting sender checks whether the collective failed
_SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)  # Linux; not in Python's socket module


class _Aborted(Exception):
    """This thread stops because another one failed (not itself an error)."""


class _Progress:
    """How many chunks a stream's receiver has finished; its sender waits on it."""

    __slots__ = ("cond", "done")

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.done = 0

    def bump(self) -> None:
        with self.cond:
            self.done += 1
            self.cond.notify_all()


class _Batch:
    """The jobs of one collective still running."""

    __slots__ = ("cond", "left")

    def __init__(self, n: int) -> None:
        self.cond = threading.Condition()
        self.left = n

    def done(self) -> None:
        with self.cond:
            self.left -= 1
            self.cond.notify_all()

    def wait(self, deadline: float) -> bool:
        """True once every job has ended; False at the deadline."""
        with self.cond:
            while self.left:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
            return True


class _Workers:
    """Threads that run a collective's jobs, kept from one collective to the next: starting and
    joining 2S threads per collective cost more than a small collective's bytes (BENCHMARKS.md,
    "Loopback"). Job i of a collective runs on worker i, so no job waits for a free thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.queues: list[queue.SimpleQueue] = []
        self.threads: list[threading.Thread] = []

    def start(self, fns: list[Callable[[], None]]) -> _Batch:
        batch = _Batch(len(fns))
        while len(self.threads) < len(fns):
            q: queue.SimpleQueue = queue.SimpleQueue()
            th = threading.Thread(target=self._loop, args=(q,), name=f"{self.name}-w{len(self.threads)}", daemon=True)
            self.queues.append(q)
            self.threads.append(th)
            th.start()
        for q, fn in zip(self.queues[:len(fns)], fns, strict=True):
            q.put((fn, batch))
        return batch

    @staticmethod
    def _loop(q: queue.SimpleQueue) -> None:
        while (item := q.get()) is not None:
            fn, batch = item
            try:
                fn()
            finally:
                batch.done()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End every worker once its job is done (the caller has shut the streams it may block on)."""
        for q in self.queues:
            q.put(None)
        for th in self.threads:
            th.join(timeout_s)
        self.queues, self.threads = [], []


class TlsComm:
    """One member of a group of `mesh.size` sites; implements `trainer.collectives.Comm`."""

    def __init__(self, mesh: Mesh, *, timeout_s: float, chunk_bytes: int = CHUNK_BYTES,
                 min_chunk_bytes: int = MIN_CHUNK_BYTES, pace_mbit: float = 0.0,
                 peer_pace: dict[int, float] | None = None, congestion: str = ""):
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"timeout_s must be a positive number, got {timeout_s}")
        if not 1 <= min_chunk_bytes <= chunk_bytes:
            raise ValueError(f"chunk sizes: need 1 <= min_chunk_bytes ({min_chunk_bytes}) <= chunk_bytes ({chunk_bytes})")
        self.mesh = mesh
        self.rank = mesh.rank
        self.size = mesh.size
        self.streams = mesh.streams
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        self.min_chunk_bytes = min_chunk_bytes
        self.bytes_sent = 0  # tensor bytes this member has sent (headers and TLS framing not counted)
        self.bytes_recv = 0  # tensor bytes received
        self._seq = 0
        self._failed: BaseException | None = None  # the first failure; the comm is unusable after it
        self._error: BaseException | None = None  # the failure of the collective in progress
        self._lock = threading.Lock()
        self._progress: list[_Progress] = []
        self._workers = _Workers(f"dlt-r{self.rank}")
        for peer in self.mesh.links:  # peer_pace: that peer's own pace (0: unpaced), over pace_mbit
            total = (peer_pace or {}).get(peer, pace_mbit)
            if total:
                self.pace(total, peers=[peer])
        if congestion:
            self.congestion(congestion)

    def pace(self, total_mbit: float, peers: list[int] | None = None) -> None:
        """Pace the S streams to each peer (of `peers`, default all) so that together they send at
        most `total_mbit`.

        Many loss-based or BBR flows overrun a shallow bottleneck queue together; each paced at
        its share of the link, they fill it without the drops (lab, 50 Mbit/s, 80 ms, 8 streams:
        40.7 Mbit/s unpaced, 45.4 paced at 49; BENCHMARKS.md).
        """
        if not (total_mbit > 0 and math.isfinite(total_mbit)):
            raise ValueError(f"pace_mbit must be a positive number, got {total_mbit}")
        per_stream = max(1, int(total_mbit * 1e6 / 8 / self.streams))  # bytes per second
        for p in self.mesh.links if peers is None else peers:
            for s in range(self.streams):
                self.mesh.tx(p, s).setsockopt(socket.SOL_SOCKET, _SO_MAX_PACING_RATE, per_stream)

    def congestion(self, name: str) -> None:
        """Use TCP congestion control `name` on every stream of this mesh (`trainer.transport.tcp_cc.apply`:
        "auto" is CUBIC, else Reno).

        A loss-based window survives a round's idle (with net.ipv4.tcp_slow_start_after_idle = 0,
        or charged by tune-h's restart model) where BBR re-probes the link: lab, 50 Mbit/s, 80 ms,
        5 s idle before each exchange, 8 streams paced at 49: 45.3 Mbit/s with cubic, 43.4 with BBR
        (BENCHMARKS.md).
        """
        for sock in self.mesh.all_sockets():
            try:
                tcp_cc.apply(sock, name)
            except tcp_cc.Refused as e:
                raise TransportError(str(e)) from None

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def failed(self) -> BaseException | None:
        """The failure that broke this comm, or None."""
        return self._failed

    def close(self) -> None:
        """Close every stream and end the workers; the comm cannot be used afterwards."""
        self.mesh.close()
        self._workers.stop()
        if self._failed is None:
            self._failed = TransportError("the comm was closed")

    def __enter__(self) -> TlsComm:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the machinery -----------------------------------------------------------------------

    def _fail(self, e: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = e
        self.mesh.abort()
        for p in self._progress:
            with p.cond:
                p.cond.notify_all()

    def _run(self, jobs: list[Callable[[float], None]], timeout_s: float | None = None) -> None:
        """Run every job on a worker of its own; all done within the timeout, or abort and raise."""
        if self._failed is not None:
            raise TransportError(f"transport unusable after an earlier failure: {self._failed}")
        self._error = None
        timeout_s = timeout_s or self.timeout_s
        deadline = time.monotonic() + timeout_s

        def body(fn: Callable[[float], None]) -> None:
            try:
                fn(deadline)
            except _Aborted:
                pass
            except BaseException as e:  # noqa: BLE001 - the collective's failure, raised below
                self._fail(e)

        batch = self._workers.start([lambda fn=fn: body(fn) for fn in jobs])
        if not batch.wait(deadline):
            self._fail(PeerLost(f"collective did not finish within its {timeout_s:.1f} s timeout"))
            batch.wait(time.monotonic() + 5.0)  # the streams are shut: every job is about to raise
        self._progress = []
        if self._error is not None:
            self._failed = self._error
            raise self._error if isinstance(self._error, TransportError) else TransportError(str(self._error))

    def _wait(self, p: _Progress, above: int, deadline: float) -> None:
        with p.cond:
            while p.done <= above:
                if self._error is not None:
                    raise _Aborted
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerLost("a chunk this member must forward did not arrive within the timeout")
                p.cond.wait(min(left, _POLL_S))

    def _chunk_elems(self, block_elems: int, itemsize: int) -> int:
        return chunk_elems(block_elems, itemsize, self.streams, self.chunk_bytes, self.min_chunk_bytes)

    @staticmethod
    def _split(start: int, count: int, ce: int) -> list[tuple[int, int]]:
        return [(o, min(ce, start + count - o)) for o in range(start, start + count, ce)]

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    @staticmethod
    def _flat(t: Tensor) -> tuple[Tensor, bool]:
        """A 1-D contiguous CPU tensor sharing t's memory when it can; (tensor, needs copy back)."""
        dtype_code(t.dtype)  # refuse what the wire cannot carry before anything is sent
        if t.device.type == "cpu" and t.is_contiguous():
            return t.detach().view(-1), False
        return t.detach().to("cpu").contiguous().view(-1), True

    # -- ring ----------------------------------------------------------------------------------

    def _ring(self, op: int, flat: Tensor, blocks: list[tuple[int, int]], steps: list[tuple[int, int, bool]],
              total: int) -> None:
        """Run `steps` (send block, receive block, add?) round the ring over `flat`'s blocks.

        The block sent at step r is the one received at step r-1, so chunk c of step r leaves as
        soon as chunk c of step r-1 has arrived. The chunks of all steps are dealt round the L lanes
        of each link in order (`Mesh.lanes`: both ends of a link count the same): chunk c of step
        r on lane (chunks before step r + c) mod L, so the stream a chunk leaves on may differ from
        the one it arrived on.
        """
        k, rank = self.size, self.rank
        right, left = (rank + 1) % k, (rank - 1) % k
        l_in, l_out = self.mesh.lanes(left), self.mesh.lanes(right)
        isz = flat.element_size()
        ce = self._chunk_elems(max(c for _, c in blocks), isz)  # group-wide S: every member cuts alike
        chunks = [self._split(st, n, ce) for st, n in blocks]
        raw = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
        seq = self._next_seq()
        # the chunks of all steps dealt round the streams in one sequence, so a step of fewer chunks
        # than streams leaves on streams whose windows the step before left free; both ends of a
        # link count alike (what this member receives at step r, its left neighbour sends at step r)
        first_in, first_out = [0], [0]
        for sb, rb, _ in steps:
            first_in.append(first_in[-1] + len(chunks[rb]))
            first_out.append(first_out[-1] + len(chunks[sb]))
        recv_lists = [[(r, c, off, n, add) for r, (_, rb, add) in enumerate(steps)
                       for c, (off, n) in enumerate(chunks[rb]) if (first_in[r] + c) % l_in == s] for s in range(l_in)]
        # (step, chunk) -> (the stream it arrives on, its place in that stream's order)
        arrives = {(r, c): (s, i) for s, items in enumerate(recv_lists) for i, (r, c, *_) in enumerate(items)}
        self._progress = progress = [_Progress() for _ in range(l_in)]
        jobs = []
        for s in range(l_out):
            send_items = [(r, c, off, n) for r, (sb, _, _) in enumerate(steps)
                          for c, (off, n) in enumerate(chunks[sb]) if (first_out[r] + c) % l_out == s]

            def send(deadline: float, s=s, items=send_items) -> None:
                sock = self.mesh.tx(right, s)
                for r, c, off, n in items:
                    if r > 0:
                        ps, i = arrives[(r - 1, c)]
                        self._wait(progress[ps], i, deadline)
                    send_all(sock, pack_header(op, flat.dtype, r, seq, c, off, n, total))
                    send_all(sock, raw[off * isz:(off + n) * isz])
                    with self._lock:
                        self.bytes_sent += n * isz

            if send_items:  # a small tensor leaves streams idle: no job for them
                jobs.append(send)
        for s, recv_items in enumerate(recv_lists):
            def recv(deadline: float, s=s, items=recv_items, prog=progress[s]) -> None:
                sock = self.mesh.rx(left, s)
                scratch = torch.empty(ce, dtype=flat.dtype) if any(a for *_, a in items) else None
                sraw = memoryview(scratch.view(torch.uint8).numpy()) if scratch is not None else None
                for r, c, off, n, add in items:
                    check_header(recv_bytes(sock, HEADER.size), pack_header(op, flat.dtype, r, seq, c, off, n, total))
                    if add:
                        recv_exact(sock, sraw[:n * isz])
                        flat[off:off + n].add_(scratch[:n])
                    else:
                        recv_exact(sock, raw[off * isz:(off + n) * isz])
                    with self._lock:
                        self.bytes_recv += n * isz
                    prog.bump()

            if recv_items:
                jobs.append(recv)
        self._run(jobs)

    # -- the Comm protocol ---------------------------------------------------------------------

    def allreduce_sum(self, t: Tensor) -> None:
        """Sum `t` over the group in place; every member ends with the same bits."""
        flat, copy_back = self._flat(t)
        k = self.size
        if k > 1:
            n = flat.numel()
            per = math.ceil(n / k)
            blocks = [(min(b * per, n), max(0, min(per, n - b * per))) for b in range(k)]
            r0 = self.rank
            # reduce-scatter: send block r0-r, receive block r0-r-1 and add; then all-gather
            steps = [((r0 - r) % k, (r0 - r - 1) % k, True) for r in range(k - 1)]
            steps += [((r0 + 1 - r) % k, (r0 - r) % k, False) for r in range(k - 1)]
            self._ring(OP_ALLREDUCE, flat, blocks, steps, n)
        if copy_back:
            t.copy_(flat.view_as(t))

    def allgather(self, t: Tensor) -> list[Tensor]:
        """Every member's `t` (same shape and dtype everywhere), ordered by rank; private copies."""
        flat, _ = self._flat(t)
        k, n = self.size, flat.numel()
        out = torch.empty(k * n, dtype=flat.dtype)
        out[self.rank * n:(self.rank + 1) * n].copy_(flat)
        if k > 1:
            r0 = self.rank
            steps = [((r0 - r) % k, (r0 - r - 1) % k, False) for r in range(k - 1)]
            self._ring(OP_ALLGATHER, out, [(b * n, n) for b in range(k)], steps, n)
        return [out[j * n:(j + 1) * n].view(t.shape).to(t.device) for j in range(k)]

    def alltoall(self, t: Tensor) -> Tensor:
        """`t` (1-D, `size` equal parts): part j goes to member j; part i of the result came from i."""
        if t.dim() != 1 or t.numel() % self.size:
            raise ValueError(f"alltoall needs a 1-D tensor of {self.size} equal parts, got shape {tuple(t.shape)}")
        flat, _ = self._flat(t)
        k, rank = self.size, self.rank
        part = flat.numel() // k
        out = torch.empty_like(flat)
        out[rank * part:(rank + 1) * part].copy_(flat[rank * part:(rank + 1) * part])
        if k > 1:
            isz = flat.element_size()
            ce = self._chunk_elems(part, isz)
            src = memoryview(flat.view(torch.uint8).numpy()) if part else memoryview(b"")
            dst = memoryview(out.view(torch.uint8).numpy()) if part else memoryview(b"")
            seq = self._next_seq()
            jobs = []
            for p in range(k):
                if p == rank:
                    continue
                # chunk offsets are within the part, so sender and receiver agree on the header
                send_chunks = self._split(0, part, ce)
                lanes = self.mesh.lanes(p)
                for s in range(lanes):
                    mine = [(c, off, n) for c, (off, n) in enumerate(send_chunks) if c % lanes == s]

                    def send(deadline: float, p=p, s=s, mine=mine) -> None:
                        sock = self.mesh.tx(p, s)
                        base = p * part
                        for c, off, n in mine:
                            send_all(sock, pack_header(OP_ALLTOALL, flat.dtype, 0, seq, c, off, n, part))
                            send_all(sock, src[(base + off) * isz:(base + off + n) * isz])
                            with self._lock:
                                self.bytes_sent += n * isz

                    def recv(deadline: float, p=p, s=s, mine=mine) -> None:
                        sock = self.mesh.rx(p, s)
                        base = p * part
                        for c, off, n in mine:
                            check_header(recv_bytes(sock, HEADER.size),
                                         pack_header(OP_ALLTOALL, flat.dtype, 0, seq, c, off, n, part))
                            recv_exact(sock, dst[(base + off) * isz:(base + off + n) * isz])
                            with self._lock:
                                self.bytes_recv += n * isz

                    if mine:
                        jobs += [send, recv]
            self._run(jobs)
        return out.to(t.device)

    # -- point to point: heal state ------------------------------------------------------------

    def send_blob(self, peer: int, data: bytes | bytearray | memoryview, timeout_s: float | None = None) -> None:
        """Send `data` to `peer` (its `recv_blob`), striped over the pair's lanes, within timeout_s
        (default: the comm's)."""
        view = memoryview(data).cast("B")
        total = len(view)
        ce = self._chunk_elems(total, 1)
        chunks = self._split(0, total, ce)
        send_all(self.mesh.tx(peer, 0), pack_header(OP_BLOB, torch.uint8, 0, 0, 0, 0, total, total))
        lanes = self.mesh.lanes(peer)

        def send(deadline: float, s: int) -> None:
            sock = self.mesh.tx(peer, s)
            for c, (off, n) in enumerate(chunks):
                if c % lanes == s:
                    send_all(sock, pack_header(OP_BLOB, torch.uint8, 1, 0, c, off, n, total))
                    send_all(sock, view[off:off + n])

        self._run([lambda d, s=s: send(d, s) for s in range(min(lanes, len(chunks)))],
                  timeout_s)
        self.bytes_sent += total

    def recv_blob(self, peer: int, max_bytes: int, timeout_s: float | None = None) -> bytearray:
        """What `peer` sends with `send_blob`; refused unread when it announces more than max_bytes."""
        raw = recv_bytes(self.mesh.rx(peer, 0), HEADER.size)
        fields = HEADER.unpack(raw)
        total = fields[7]
        if fields[8] != total:  # not a length announcement: let check_header name what it was
            total = 0
        check_header(raw, pack_header(OP_BLOB, torch.uint8, 0, 0, 0, 0, total, total))
        if total > max_bytes:
            err = TransportError(f"peer announced {total} bytes of heal state, more than the {max_bytes} allowed")
            self._failed = err
            raise err
        buf = bytearray(total)
        view = memoryview(buf)
        chunks = self._split(0, total, self._chunk_elems(total, 1))
        lanes = self.mesh.lanes(peer)

        def recv(deadline: float, s: int) -> None:
            sock = self.mesh.rx(peer, s)
            for c, (off, n) in enumerate(chunks):
                if c % lanes == s:
                    check_header(recv_bytes(sock, HEADER.size), pack_header(OP_BLOB, torch.uint8, 1, 0, c, off, n, total))
                    recv_exact(sock, view[off:off + n])

        self._run([lambda d, s=s: recv(d, s) for s in range(min(lanes, len(chunks)))],
                  timeout_s)
        self.bytes_recv += total
        return buf


__all__ = ["TlsComm"]
