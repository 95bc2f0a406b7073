"""One round's collectives for the Compressor, their byte accounting, and the means over what came back.

`PhaseExchange` moves each phase's WireBuffer (trainer.codecs.wire_buffer) through the comm by the phase's
op: "sum" is all-reduced, "gather" all-gathered, "qsum" and "ssum" averaged shard by shard
(trainer.codecs.quant_shards.QuantShards, trainer.codecs.sparse_codec.SparseShards: an all-to-all, then an
all-gather). `weighted_mean`, `finite_mean` and `joined` are what the receiving site does with the
buffers it got (trainer.codecs.compression.Compressor.average and .contributions).

Byte accounting (WireStats): `payload` is the nbytes of the tensors this site hands to the comm.
A ring all-reduce of n bytes over K members is counted as 2(K-1)/K * n bytes sent and as many
received; an all-gather of n bytes as (K-1) * n sent and (K-1) * n received; a quantized average
as the (K-1) shard messages of its all-to-all plus the (K-1) of its all-gather (rounded down to
whole bytes, per round). A group of one moves nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from torch import Tensor

from trainer.codecs.quant_shards import QuantShards
from trainer.codecs.sparse_codec import SparseShards
from trainer.codecs.wire_buffer import WireBuffer
from trainer.collectives import Comm
from trainer.rules.codec_spec import Phase


@dataclass(kw_only=True, slots=True)
class WireStats:
    bytes_sent: int  # bytes this site put on the wire (ring/all-gather factors applied)
    bytes_recv: int  # bytes this site received
    payload: int = 0  # nbytes of the tensors handed to the comm (= payload_bytes(spec, shapes))
    dense: int = 0  # fp32 bytes of the deltas: payload / dense is the compression ratio
    collectives: int = 0  # collective calls made (each one WAN round trip or more)


def wire_cost(op: str, nbytes: int, k: int) -> Fraction:
    """Bytes sent (= received) by one member for one collective of `nbytes` over `k` members."""
    if k <= 1:
        return Fraction(0)
    return Fraction(2 * (k - 1) * nbytes, k) if op == "sum" else Fraction((k - 1) * nbytes)


class PhaseExchange:
    """One round's phases through `comm`, each one's bytes counted into `stats` (`dense`: the fp32
    bytes of the deltas).

    `send` moves a buffer by its phase's op (what `average` does); `gather` all-gathers it whole
    (what `contributions` does). `shards(phase, k)` gives the shards a "qsum" or "ssum" phase is
    averaged in (the Compressor keeps them: their owners' residuals are its state); `gen` and
    `error_feedback` are the Compressor's, `weight` this site's for the round, `rank_weights` and
    `norm_ratio` the sparse shard owners' (SparseShards.reduce). What the sparse owners merged is
    left in `merged` (by parameter index), their verdict in `screened`: (ranks an owner dropped,
    whether one refused the round).
    """

    def __init__(self, comm: Comm, *, dense: int,
                 shards: Callable[[Phase, int], QuantShards | SparseShards] | None = None,
                 gen: torch.Generator | None = None, error_feedback: bool = False, weight: float = 1.0,
                 rank_weights: Sequence[float] | None = None, norm_ratio: float = 0.0):
        self.comm = comm
        self.stats = WireStats(bytes_sent=0, bytes_recv=0, dense=dense)
        self.shards = shards
        self.gen = gen
        self.error_feedback = error_feedback
        self.weight = weight
        self.rank_weights = rank_weights
        self.norm_ratio = norm_ratio
        self.cost = Fraction(0)
        self.merged: dict[int, Tensor] = {}
        self.screened: list[Any] = [set(), False]

    def send(self, buf: WireBuffer) -> list[WireBuffer]:
        """This site's `buf` exchanged: the summed buffer, every member's buffer, or the averaged one."""
        comm, stats = self.comm, self.stats
        n, op = buf.phase.nbytes, buf.phase.op
        stats.payload += n
        stats.collectives += 1
        if op == "sum":
            self.cost += wire_cost(op, n, comm.size)
            comm.allreduce_sum(buf.wire)
            return [buf]
        if op == "gather":
            self.cost += wire_cost(op, n, comm.size)
            return [WireBuffer(buf.phase, t) for t in comm.allgather(buf.wire)]
        if comm.size == 1:  # nothing to average; the buffer still passes the comm (async mode captures it)
            return [WireBuffer(buf.phase, comm.allgather(buf.wire)[0])]
        assert self.shards is not None
        sh = self.shards(buf.phase, comm.size)
        stats.collectives += 1  # all-to-all, then all-gather
        if isinstance(sh, SparseShards):
            self.cost += (comm.size - 1) * (sh.msg + sh.msg_out)
            mine = sh.reduce(comm.alltoall(sh.pack(buf.bytes, self.weight)), comm.rank, self.error_feedback,
                             self.rank_weights, self.norm_ratio)
            self.merged, total, *verdict = sh.unpack(comm.allgather(mine))
            self.screened[:] = verdict
            merged = WireBuffer(buf.phase)
            merged.view(-1, "weight").fill_(total)
            return [merged]
        self.cost += 2 * (comm.size - 1) * sh.msg
        mine = sh.reduce(comm.alltoall(sh.pack(buf, self.weight)), comm.rank, self.gen, self.error_feedback)
        return [sh.unpack(comm.allgather(mine), buf.phase)]

    def gather(self, buf: WireBuffer) -> list[WireBuffer]:
        """Every member's `buf`, all-gathered whole (no summing on the way, no shard owner)."""
        self.stats.payload += buf.phase.nbytes
        self.stats.collectives += 1
        self.cost += wire_cost("gather", buf.phase.nbytes, self.comm.size)
        return [WireBuffer(buf.phase, t) for t in self.comm.allgather(buf.wire)]

    def settle(self) -> WireStats:
        """The round's stats, its bytes sent and received rounded down to whole bytes."""
        self.stats.bytes_sent = self.stats.bytes_recv = math.floor(self.cost)
        return self.stats


def apply_weight(buf: WireBuffer, weight: float) -> None:
    # summed buffers carry weight * contribution; gathered ones are weighted by the receiver
    if buf.phase.op == "sum" and weight != 1.0:
        w = buf.view(-1, "weight").clone() if buf.has(-1, "weight") else None
        buf.wire.mul_(weight)
        if w is not None:
            buf.view(-1, "weight").copy_(w)


def weighted_mean(bufs: list[WireBuffer], weights: list[float], total: float, decode) -> Tensor:
    """sum_k w_k * decode(buf_k) / total over what `send` returned (a summed or averaged phase: its one buffer)."""
    if bufs[0].phase.op == "qsum":
        return decode(bufs[0])  # averaged shard by shard already
    if len(bufs) == 1 and bufs[0].phase.op == "sum":
        return decode(bufs[0]) / total  # already summed (weights applied by each sender)
    acc = None
    for b, w in zip(bufs, weights, strict=True):
        if w == 0:
            continue  # sent zeros; skip the decode
        v = decode(b)
        acc = v * w if acc is None else acc.add_(v, alpha=w)
    assert acc is not None
    return acc / total


def finite_mean(xs: list[Tensor], weights: list[float]) -> Tensor:
    """Weighted mean of the finite tensors among `xs` whose weight is > 0 (zeros if there are none):
    one site's NaN must not poison what every site shares (PowerSGD's P^ and Q)."""
    kept = [(x, w) for x, w in zip(xs, weights, strict=True) if w > 0 and bool(torch.isfinite(x).all())]
    if not kept:
        return torch.zeros_like(xs[0])
    return sum(x * w for x, w in kept) / sum(w for _, w in kept)


def joined(parts: list[Tensor]) -> Tensor:
    """torch.cat(parts), or one view of them where they lie end to end in one storage (a lossless
    codec's fields, decoded in place from the received buffer): a 43 MB copy less per site."""
    first = parts[0]
    ends = first.storage_offset()
    for t in parts:
        if t.dtype != first.dtype or t.dim() != 1 or not t.is_contiguous() or t.storage_offset() != ends or \
                t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return torch.cat(parts)
        ends += t.numel()
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (ends - first.storage_offset(),))
