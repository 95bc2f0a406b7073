"""Averaging a quantized phase ("qsum") shard by shard: `QuantShards`.

Quantized numbers cannot be summed in their wire form, so an int8, fp8 or fp4 buffer is averaged
shard by shard: its quantizer chunks are cut into K shards of about equal bytes; an all-to-all
hands shard j of every site to site j, which decodes and averages them in fp32, quantizes the
average again (its own error feedback keeps what that loses for its next average) and all-gathers
it. Each site sends about 2(K-1)/K of its payload, as a ring all-reduce would (the scheme of
torchft's fp8 collective and prime's int8 ring). The sparse codec's counterpart is
trainer.codecs.sparse_codec.SparseShards; trainer.codecs.phase_exchange drives both.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trainer.codecs.owner_feedback import OwnerFeedback
from trainer.codecs.quantize import from_codes, pack, to_codes, unpack, wire_scale
from trainer.codecs.wire_buffer import DTYPES, WireBuffer
from trainer.rules.codec_spec import PACKED, QMAX, SCALE_DTYPES, CodecOptions, Phase


class QuantShards(OwnerFeedback):
    """A "qsum" phase's quantizer chunks split into `k` shards of about equal bytes.

    Shard j is a contiguous run of chunks (each chunk: one scale and up to `chunk` codes); in the
    buffer its scales and codes are a few contiguous byte ranges (one per field it touches). Its
    message is [sender's weight, fp32][the chunks' scales][their codes], padded to `msg` bytes
    (the same for every shard, as all-to-all and all-gather need).
    """

    def __init__(self, phase: Phase, k: int, opts: CodecOptions):
        qs = [f for f in phase.fields if f.role.endswith("q")]
        # packed codes are fp4's (the one packed quantizer)
        self.vec = "int8" if qs and qs[0].dtype == "i8" else "fp4" if any(f.values for f in qs) else "fp8"
        per = PACKED.get(self.vec, 1)
        self.scale_dtype = DTYPES[SCALE_DTYPES[opts.scale_dtype]]
        ss = self.scale_dtype.itemsize
        fields = []  # per q field: (code offset, scale offset, chunk lengths in buffer order)
        for f in qs:
            run = (f.values or f.count) // f.groups
            chunk = min(opts.chunk, max(run, 1))
            j = torch.arange(-(-run // chunk))
            lens = torch.minimum(torch.full_like(j, chunk), run - j * chunk).repeat(f.groups)
            fields.append((f.offset, phase.field(f.param, f.role[:-1] + "scale").offset, lens))
        length = torch.cat([ln for *_, ln in fields]) if fields else torch.zeros(0, dtype=torch.long)
        ends = length.cumsum(0)
        total = int(ends[-1]) if len(ends) else 0
        bounds = [0, *torch.searchsorted(ends, torch.arange(1, k) * total / k, right=True).tolist(), len(length)]
        # per shard: scale byte ranges, code byte ranges, the chunks' lengths
        self.parts: list[tuple[list[tuple[int, int]], list[tuple[int, int]], Tensor]] = []
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            scales, codes, first = [], [], 0
            for q_off, s_off, lens in fields:
                lo, hi = max(a - first, 0), min(b - first, len(lens))
                if lo < hi:
                    nb = -(-lens // per)  # code bytes of each chunk
                    codes.append((q_off + int(nb[:lo].sum()), int(nb[lo:hi].sum())))
                    scales.append((s_off + lo * ss, (hi - lo) * ss))
                first += len(lens)
            self.parts.append((scales, codes, length[a:b]))
        self.msg = 4 + max(sum(n for _, n in sc) + sum(n for _, n in co) for sc, co, _ in self.parts)
        self.msg += -self.msg % 4
        self.weight = phase.field(-1, "weight") if any(f.param == -1 for f in phase.fields) else None
        self.k = k

    def pack(self, buf: WireBuffer, weight: float) -> Tensor:
        """Message j of the all-to-all: shard j of this site's encoded buffer."""
        out = torch.zeros(len(self.parts), self.msg, dtype=torch.uint8)
        out[:, :4] = torch.tensor([weight], dtype=torch.float32).view(torch.uint8)
        for j, (scales, codes, _) in enumerate(self.parts):
            pos = 4
            for off, n in scales + codes:
                out[j, pos:pos + n] = buf.bytes[off:off + n]
                pos += n
        return out.view(-1)

    def reduce(self, got: Tensor, j: int, gen: torch.Generator | None, error_feedback: bool) -> Tensor:
        """Shard j averaged over the senders' messages (weighted, in fp32) and quantized again."""
        scales, codes, lens = self.parts[j]
        sn, nb, nq = sum(n for _, n in scales), sum(n for _, n in codes), int(lens.sum())  # nb code bytes, nq values
        msgs = got.view(-1, self.msg)
        weights = msgs[:, :4].clone().view(torch.float32).view(-1)
        total = float(weights.sum())
        acc = torch.zeros(nq)
        for m, w in zip(msgs, weights.tolist(), strict=True):
            if w == 0:
                continue
            scale = m[4:4 + sn].clone().view(self.scale_dtype).float()
            v = from_codes(unpack(m[4 + sn:4 + sn + nb], lens, self.vec), self.vec)
            acc.add_(v * scale.repeat_interleave(lens), alpha=w)
        mean = acc / total if total > 0 else acc
        feedback = error_feedback and total > 0
        if feedback:
            self.add_residual(mean, j)  # the owner's error feedback of the second quantization
        out = torch.zeros(self.msg, dtype=torch.uint8)
        out[:4] = torch.tensor([total], dtype=torch.float32).view(torch.uint8)
        wire = torch.zeros(len(lens), dtype=self.scale_dtype)
        amax = torch.segment_reduce(mean.abs(), "max", lengths=lens) if nq else torch.zeros(0)
        scale = wire_scale(amax / QMAX[self.vec], wire).repeat_interleave(lens)
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        out[4:4 + sn] = wire.view(torch.uint8)
        q = to_codes(mean * inv, self.vec, gen)
        out[4 + sn:4 + sn + nb] = pack(q, lens, self.vec)
        if feedback:
            self.keep_residual(mean - from_codes(q, self.vec) * scale)
        return out

    def unpack(self, msgs: list[Tensor], phase: Phase) -> WireBuffer:
        """The averaged buffer from every shard's reduced message; its weight field holds the total."""
        buf = WireBuffer(phase)
        for (scales, codes, _), m in zip(self.parts, msgs, strict=True):
            pos = 4
            for off, n in scales + codes:
                buf.bytes[off:off + n] = m[pos:pos + n]
                pos += n
        if self.weight is not None:
            buf.view(-1, "weight").copy_(msgs[0][:4].clone().view(torch.float32))
        return buf

