"""One phase's wire buffer, and how each parameter's values are written into it and read back.

A phase of the exchange (trainer.rules.codec_spec.Phase) is one flat buffer: fp32 for a summed phase,
bytes otherwise, laid out by the wire plan as typed fields (param, role). `WireBuffer` gives typed
views of those fields; `RouteCodec` encodes a parameter by its route (trainer.rules.codec_spec.Route) into
them and decodes it back: a dense vector (fp32, or quantized by trainer.codecs.quantize), top-k values
with their indices, or the sparse codec's records (trainer.codecs.sparse_codec). Top-k's receivers average
each coordinate over the sites that sent a value there (`RouteCodec.topk_mean`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from trainer.codecs import sparse_codec
from trainer.codecs.quantize import dequantize, quantize
from trainer.rules.codec_spec import CodecOptions, Field, Phase, Route, sparse_record

DTYPES = {"f32": torch.float32, "i32": torch.int32, "f16": torch.float16, "bf16": torch.bfloat16,
          "i16": torch.int16, "i8": torch.int8, "u8": torch.uint8}
_OFFSET16 = 32768  # int16 offsets are stored shifted so a block of up to 65536 fits


class WireBuffer:
    """One phase's wire buffer with typed views of its fields."""

    def __init__(self, phase: Phase, raw: Tensor | None = None):
        self.phase = phase
        if raw is None:
            # sums are fp32 all the way; gathers are bytes
            raw = torch.zeros(phase.nbytes // 4, dtype=torch.float32) if phase.op == "sum" \
                else torch.zeros(phase.nbytes, dtype=torch.uint8)
        self.wire = raw
        b = raw.contiguous().view(torch.uint8)
        if b.storage_offset() % 4:
            b = b.clone()  # views of wider types need an aligned start
        self.bytes = b
        self._fields = {(f.param, f.role): f for f in phase.fields}

    def view(self, param: int, role: str) -> Tensor:
        f: Field = self._fields[(param, role)]
        return self.bytes[f.offset:f.offset + f.nbytes].view(DTYPES[f.dtype])

    def has(self, param: int, role: str) -> bool:
        return (param, role) in self._fields

    def values(self, param: int, role: str) -> int:
        """Values field (param, role) stands for (packed fp4 codes: twice its bytes, about)."""
        f = self._fields[(param, role)]
        return f.values or f.count


class RouteCodec:
    """Each route's values into and out of a WireBuffer, with a Compressor's options and its
    stochastic-rounding generator (None: round to nearest)."""

    def __init__(self, options: CodecOptions, gen: torch.Generator | None):
        self.options = options
        self.gen = gen

    def encode_vec(self, x: Tensor, vec: str, buf: WireBuffer, i: int, prefix: str, groups: int = 1) -> None:
        """Encode x (flattened as `groups` runs of equal length) into field `prefix` of param i."""
        p = f"{prefix}." if prefix else ""
        if vec == "raw":
            buf.view(i, f"{p}raw").copy_(x.reshape(-1))
        else:
            quantize(x.reshape(groups, -1), vec, self.options, self.gen, buf.view(i, f"{p}scale"), buf.view(i, f"{p}q"))

    def decode_vec(self, vec: str, buf: WireBuffer, i: int, prefix: str, groups: int = 1) -> Tensor:
        p = f"{prefix}." if prefix else ""
        if vec == "raw":
            return buf.view(i, f"{p}raw")
        return dequantize(buf.view(i, f"{p}scale"), buf.view(i, f"{p}q"), vec, self.options.chunk, groups,
                          buf.values(i, f"{p}q"))

    def encode_topk(self, x: Tensor, r: Route, buf: WireBuffer) -> None:
        if r.block:
            pad = r.blocks * r.block - r.numel
            a = x.abs()
            if pad:
                a, x = F.pad(a, (0, pad), value=-1.0), F.pad(x, (0, pad))  # padding is never chosen first
            idx = a.view(r.blocks, r.block).topk(r.k, dim=1, sorted=False).indices
            vals = x.view(r.blocks, r.block).gather(1, idx).view(-1)
            buf.view(r.index, "index").copy_(idx.view(-1) - _OFFSET16)
        else:
            idx = x.abs().topk(r.k, sorted=False).indices
            vals = x[idx]
            buf.view(r.index, "index").copy_(idx)
        self.encode_vec(vals, r.vec, buf, r.index, "values")

    @staticmethod
    def encode_sparse(x: Tensor, r: Route, buf: WireBuffer) -> None:
        for (role, _, _), t in zip(sparse_record(r), sparse_codec.encode(x, r.block, r.k, r.vec), strict=True):
            buf.view(r.index, role).copy_(t.reshape(-1))

    def topk_sent(self, buf: WireBuffer, r: Route) -> tuple[Tensor, Tensor]:
        """(flat positions, values) of what a top-k buffer carries, values that decode to 0 left
        out: they say nothing, and block padding (zeros past r.numel) is among them."""
        vals = self.decode_vec(r.vec, buf, r.index, "values")
        idx = buf.view(r.index, "index").long()
        if r.block:
            base = torch.arange(r.blocks, dtype=torch.long)[:, None] * r.block
            idx = ((idx + _OFFSET16).view(r.blocks, r.k) + base).view(-1)
        keep = vals != 0
        return idx[keep], vals[keep]

    @staticmethod
    def decode_sparse(buf: WireBuffer, r: Route) -> Tensor:
        pos, vals = sparse_codec.decode(*sparse_codec.route_records(buf.bytes, buf.phase, r), r.block, r.k, r.vec, r.numel)
        return torch.zeros(r.numel).index_put_((pos,), vals)

    def decode_topk(self, buf: WireBuffer, r: Route) -> Tensor:
        idx, vals = self.topk_sent(buf, r)
        return torch.zeros(r.numel).index_put_((idx,), vals)

    def topk_mean(self, bufs: list[WireBuffer], weights: list[float], r: Route) -> Tensor:
        """A top-k parameter averaged, coordinate by coordinate, over the sites that sent a value there.

        Sites pick mostly different coordinates (at 1% and K = 4 about 4% of the coordinates
        carry one site's value), so the plain mean sum_k w_k x_k / sum_k w_k would shrink most
        sent values K-fold; in bench/compression.py that shrink, not the bytes, was most of
        top-k's perplexity gap. A site's residual keeps what it did not send, whatever the
        others sent there (as SparseLoCo and CCLoco do): booking the senders' excess against
        it instead did better at long runs with Nesterov outer momentum but much worse with
        plain outer SGD, top-k's best setting (BENCHMARKS.md, compression).
        """
        acc = torch.zeros(r.numel)
        count = torch.zeros(r.numel)  # summed weight of the sites that sent a value there
        for b, w in zip(bufs, weights, strict=True):
            if w == 0:
                continue
            idx, vals = self.topk_sent(b, r)  # sparse: no dense pass per site
            acc.index_add_(0, idx, vals, alpha=w)
            count.index_add_(0, idx, torch.full_like(vals, w))
        return torch.where(count > 0, acc / count.clamp(min=1e-30), 0.0)
