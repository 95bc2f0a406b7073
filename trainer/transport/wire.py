"""What crosses a transport connection: a hello per connection and one fixed header per chunk.

Nothing is unpickled: a chunk is a 40-byte header and the chunk's raw bytes. The receiver knows
from its own call what every chunk must be (collective, sequence number, step, chunk index,
dtype, offset, element count, total elements) and compares the header with that before it reads
the body into memory it chose; a header that differs fails the collective (CollectiveMismatch),
so a peer can never make this end read more than the chunk it expects or write elsewhere.
"""

from __future__ import annotations

import struct

import torch

from trainer.transport.tls import TransportError

MAGIC_HELLO = b"DLH1"
MAGIC_CHUNK = b"DLC1"
# magic, version, session (16 bytes), from rank, to rank, stream, streams, group size, and whether
# the sender would carry this stream in the clear after the hello (both ends on loopback; mesh.py)
HELLO = struct.Struct("!4sB16sHHHHHB")
# magic, op, dtype code, step, sequence, chunk, offset, count, total
HEADER = struct.Struct("!4sBBHIIQQQ")
# 3: a ring block is cut into a multiple of S chunks (trainer/rules/chunk_rule.py); members that cut
# differently cannot share a ring, so an older peer is refused at the hello, not mid-collective
# 4: a ring's chunks are dealt round the streams over all its steps, not from stream 0 at each step
VERSION = 4

OP_ALLREDUCE, OP_ALLGATHER, OP_ALLTOALL, OP_BLOB = 1, 2, 3, 4
OP_NAMES = {OP_ALLREDUCE: "allreduce_sum", OP_ALLGATHER: "allgather", OP_ALLTOALL: "alltoall", OP_BLOB: "blob"}

DTYPES: dict[torch.dtype, int] = {
    torch.float32: 1, torch.float64: 2, torch.float16: 3, torch.bfloat16: 4, torch.uint8: 5,
    torch.int8: 6, torch.int16: 7, torch.int32: 8, torch.int64: 9, torch.bool: 10,
}
CODES = {v: k for k, v in DTYPES.items()}


class CollectiveMismatch(TransportError):
    """A peer sent a chunk other than the one this end's own call expects (shapes or order differ)."""


class PeerLost(TransportError):
    """A peer closed its connection or stopped sending within the timeout."""


def dtype_code(dtype: torch.dtype) -> int:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise TypeError(f"the transport does not carry {dtype}") from None


def pack_header(op: int, dtype: torch.dtype, step: int, seq: int, chunk: int, offset: int, count: int,
                total: int) -> bytes:
    return HEADER.pack(MAGIC_CHUNK, op, dtype_code(dtype), step, seq & 0xFFFFFFFF, chunk, offset, count, total)


def describe(fields: tuple) -> str:
    _, op, code, step, seq, chunk, offset, count, total = fields
    dt = CODES.get(code, f"dtype#{code}")
    return (f"{OP_NAMES.get(op, f'op#{op}')} #{seq} step {step} chunk {chunk}: "
            f"{count} x {dt} at {offset} of {total}")


def check_header(raw: bytes, expected: bytes) -> None:
    """Raise CollectiveMismatch (naming both) unless the received header is the expected one."""
    if raw != expected:
        try:
            got = describe(HEADER.unpack(raw)) if raw[:4] == MAGIC_CHUNK else f"bytes {raw[:8]!r}..."
        except struct.error:
            got = f"{len(raw)} bytes"
        raise CollectiveMismatch(f"collective mismatch: peer sent {got}; this site expects "
                                 f"{describe(HEADER.unpack(expected))}")


def recv_exact(sock, view: memoryview) -> None:
    """Fill `view` from `sock`; PeerLost on end of stream or timeout."""
    got = 0
    n = len(view)
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got)
        except TimeoutError:
            raise PeerLost("peer sent nothing within the timeout") from None
        except OSError as e:
            raise PeerLost(f"connection to peer lost: {e}") from None
        if k == 0:
            raise PeerLost("peer closed the connection")
        got += k


def recv_bytes(sock, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact(sock, memoryview(buf))
    return bytes(buf)


def send_all(sock, data) -> None:
    try:
        sock.sendall(data)
    except TimeoutError:
        raise PeerLost("peer took nothing within the timeout") from None
    except OSError as e:
        raise PeerLost(f"connection to peer lost: {e}") from None
