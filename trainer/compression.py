"""Pseudo-gradient compression with error feedback for the outer exchange.

Every site of the quorum runs, once per outer round:

    comp = Compressor(spec="powersgd:16+int8", error_feedback=True, seed=0)   # once
    averaged, stats = comp.average(deltas, comm, weight)

and gets back the same `averaged` list: sum_k w_k * decoded_k / sum_k w_k over the sites, where
decoded_k is what site k's wire form decodes to (top-k: over the sites that sent each coordinate).
The wire layout of every spec is planned from the shapes alone (`trainer.codec_spec.wire_plan`),
so `payload_bytes` is exact without torch.

Codecs (spec stages, see trainer.codec_spec):
  none         one flat fp32 buffer, all-reduced (sum), divided by the summed weight.
  int8, fp8,   per-chunk scale (max |x| / 127, or / 448 for e4m3fn, or / 6 for e2m1), fp32/fp16/bf16
  fp4          scales, round-to-nearest or stochastic rounding. fp4 (e2m1: magnitudes 0, 0.5, 1,
               1.5, 2, 3, 4, 6) packs two codes a byte, the first in the low half; every chunk
               starts on a fresh byte (ceil(len/2) bytes). Quantized numbers cannot be summed in
               their wire form, so they are averaged shard by shard ("qsum"): the buffer's chunks
               are cut into K shards; an all-to-all hands shard j of every site to site j, which
               decodes and averages them in fp32, quantizes the average again (its own error
               feedback keeps what that loses for its next average) and all-gathers it. Each site
               sends about 2(K-1)/K of its payload, as a ring all-reduce would (the scheme of
               torchft's fp8 collective and prime's int8 ring).
  topk:F       the largest |x|, values + indices: the ceil(F*b) largest of every block of b values
               (options.topk_block, 4096 by default) with int16 offsets, or, when that is
               cheaper, the ceil(F*n) largest of the tensor with int32 indices. A tensor for which
               top-k would not save bytes is sent dense. All-gathered; each coordinate is averaged
               over the sites that sent a value there (their summed weight), not over all sites:
               sites mostly pick different coordinates, and the plain mean would shrink most
               values K-fold.
  sparse:F     SparseLoCo's codec (trainer.sparse_codec): chunked top-k with 2-bit values (or int8)
               and 12-bit offsets, reduced shard by shard ("ssum": all-to-all to each shard's
               owner, which merges, re-selects and all-gathers), so its bytes do not grow with K.
  powersgd:R   a parameter with >= 2 dims is viewed as rows x cols (shape[0] x the rest) and sent
               as P = M Q (rows x R), all-reduced and averaged, orthonormalised (QR) into P^, then
               Q = M^T P^ (cols x R), all-reduced and averaged; the decoded matrix is P^ Q^T. Both
               steps are linear in M, so summing is exact. Q is warm-started from the previous
               round's average (initially the same seeded normal matrix at every site) and
               orthonormalised before use: same span, but P's columns stay comparable in size,
               which is what keeps a quantized P accurate. 1-D parameters and matrices that would
               not gain (rows*cols < gain * R*(rows+cols)) take the plain path: fp32, or the
               quantizer of the chain.
  A+Q          a quantizer Q (int8, fp8, fp4) encodes what the first stage sends (top-k values; P
               and Q, column by column, no chunk straddling two columns); P and Q are averaged
               shard by shard, the top-k values all-gathered.

Weights: 1.0 for a participating site, 0.0 for one that must not contribute (it has just
healed). Every site makes the same collective calls with the same shapes whatever its weight; a
weight-0 site sends zeros and gets the same result. The weight travels inside the first buffer
(one fp32), so the denominator needs no extra collective.

Error feedback (per site): x = delta + e is compressed, and e <- decay * (x - own), where own is
what this site's wire form decodes to; not updated when the weight is 0. With decay 1 the running
sum of the averages plus the weighted mean residual is the running sum of the weighted mean inputs
(dense codecs, PowerSGD; top-k at one site: the senders' mean is not a mean of the inputs), within
a bound that does not grow with the rounds. Lossless paths (fp32) keep no residual. A shard's
owner keeps a second residual: what its re-quantized average lost, added to the next average of
the same shard (reset when the group size changes the shards). Both are part of the checkpoint
(`state_dict`).

What the comm sees: per round one or two phases (PowerSGD: P, then Q), each on a 1-D tensor:
`allreduce_sum` on fp32 ("none", PowerSGD without a quantizer), `alltoall` then `allgather` on
uint8 (int8/fp8/fp4), `allgather` on uint8 (top-k). Every site must use the same spec, options and
parameter shapes.

Byte accounting (WireStats): `payload` is the nbytes of the tensors this site hands to the comm.
A ring all-reduce of n bytes over K members is counted as 2(K-1)/K * n bytes sent and as many
received; an all-gather of n bytes as (K-1) * n sent and (K-1) * n received; a quantized average
as the (K-1) shard messages of its all-to-all plus the (K-1) of its all-gather (rounded down to
whole bytes, per round). A group of one moves nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from trainer import sparse_codec
from trainer.codec_spec import (
    PACKED,
    QMAX,
    SCALE_DTYPES,
    CodecOptions,
    Field,
    Phase,
    Route,
    WirePlan,
    parse_codec_spec,
    payload_bytes,
    sparse_record,
    wire_plan,
)
from trainer.comm import Comm
from trainer.norms import sq_sum

_DTYPES = {"f32": torch.float32, "i32": torch.int32, "f16": torch.float16, "bf16": torch.bfloat16,
           "i16": torch.int16, "i8": torch.int8, "u8": torch.uint8}
_OFFSET16 = 32768  # int16 offsets are stored shifted so a block of up to 65536 fits


class NonFiniteDelta(ValueError):
    """A pseudo-gradient holds NaN or Inf; raised before anything is sent."""

    def __init__(self, index: int, shape: tuple[int, ...]):
        super().__init__(f"pseudo-gradient of parameter {index} (shape {shape}) holds NaN/Inf; nothing was sent")
        self.index = index


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


# --- vector codecs: fp32 numbers <-> typed runs in a byte buffer -----------------------------


def _wire_scale(scale: Tensor, out: Tensor) -> Tensor:
    """Write `scale` into `out` (its wire dtype) and return the fp32 value the receiver will see."""
    sdt = out.dtype
    if sdt == torch.float32:
        out.copy_(scale)
        return scale
    # round the scale up, never down: a smaller scale would clip the chunk's largest value
    wire = scale.clamp(max=torch.finfo(sdt).max).to(sdt)
    wire = torch.where(wire.float() < scale, torch.nextafter(wire, torch.tensor(math.inf, dtype=sdt)), wire)
    out.copy_(wire)
    return wire.float()


def _codes(y: Tensor, vec: str, gen: torch.Generator | None) -> Tensor:
    """One code per scaled value y: int8 (|y| <= 127), e4m3fn bits (|y| <= 448) or e2m1 bits (|y| <= 6)."""
    if vec == "int8":
        y = torch.floor(y + torch.rand(y.shape, generator=gen)) if gen is not None else torch.round(y)
        return y.clamp_(-127, 127).to(torch.int8)
    if vec == "fp4":
        return _fp4_bits(y.clamp_(-6.0, 6.0), gen)
    return _fp8_bits(y.clamp_(-448.0, 448.0), gen)


def _decoded(codes: Tensor, vec: str) -> Tensor:
    """fp32 values of one-per-value codes (int8 or uint8 storage), inverse of `_codes` (unscaled)."""
    if vec == "int8":
        return codes.view(torch.int8).float()
    if vec == "fp4":
        return _E2M1_SIGNED[codes.long()]
    return codes.view(torch.float8_e4m3fn).float()


def _chunk_lens(run: int, chunk: int, groups: int) -> Tensor:
    """Values of each quantizer chunk, in buffer order, of `groups` runs of `run` values."""
    full, last = divmod(run, chunk)
    return torch.tensor([chunk] * full + ([last] if last else []), dtype=torch.long).repeat(groups)


def _slots(lens: Tensor, per: int) -> Tensor | None:
    """Which code slots of the packed bytes hold a value (None: all): each chunk starts on a fresh
    byte, so a chunk of odd length (fp4) leaves its last byte's high half empty."""
    if not bool((lens % per).any()):
        return None
    width = -(-lens // per) * per  # slots per chunk
    start = width.cumsum(0) - width
    pos = torch.arange(int(width.sum())) - start.repeat_interleave(width)
    return pos < lens.repeat_interleave(width)


def _pack(codes: Tensor, lens: Tensor, vec: str) -> Tensor:
    """`codes` (one per value, chunks of `lens` values) as wire bytes: PACKED[vec] to a byte, the
    first code in the low bits; codes of unpacked quantizers as they are."""
    per = PACKED.get(vec, 1)
    if per == 1:
        return codes.view(torch.uint8)
    used = _slots(lens, per)
    if used is None:
        slots = codes.view(torch.uint8).view(-1, per)
    else:
        slots = torch.zeros(len(used), dtype=torch.uint8)
        slots[used] = codes
        slots = slots.view(-1, per)
    bits, out = 8 // per, slots[:, 0].clone()
    for j in range(1, per):
        out |= slots[:, j] << (bits * j)
    return out


def _unpack(b: Tensor, lens: Tensor, vec: str) -> Tensor:
    """One code per value from wire bytes `b`, inverse of `_pack`."""
    per = PACKED.get(vec, 1)
    if per == 1:
        return b
    bits = 8 // per
    b = b.view(torch.uint8)
    slots = torch.stack([(b >> (bits * j)) & ((1 << bits) - 1) for j in range(per)], dim=1).view(-1)
    used = _slots(lens, per)
    return slots if used is None else slots[used]


def _quantize(x: Tensor, vec: str, opts: CodecOptions, gen: torch.Generator | None,
              scale_out: Tensor, q_out: Tensor) -> None:
    """Quantize the rows of x (groups x run) in chunks that stay inside a row."""
    groups, run = x.shape
    chunk = min(opts.chunk, max(run, 1))
    pad = -run % chunk
    xp = (F.pad(x, (0, pad)) if pad else x).reshape(-1, chunk)
    scale = _wire_scale(xp.abs().amax(dim=1) / QMAX[vec], scale_out)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = _codes(xp * inv[:, None], vec, gen).view(groups, run + pad)
    q = (q[:, :run] if pad else q).reshape(-1)
    q_out.copy_(_pack(q, _chunk_lens(run, chunk, groups), vec).view(q_out.dtype))


# e2m1 (fp4): sign in bit 3, the magnitude's index in bits 0-2 (2 exponent bits, 1 mantissa bit)
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_E2M1_SIGNED = torch.cat([_E2M1, -_E2M1])
# index of the largest magnitude <= a, by floor(4a) (the magnitudes are multiples of 0.25)
_E2M1_FLOOR = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 6, 7])


def _fp4_bits(y: Tensor, gen: torch.Generator | None) -> Tensor:
    """e2m1 bit patterns (uint8, 0-15) of y (|y| <= 6), nearest (ties to even) or stochastically rounded."""
    a = y.abs()
    lo = _E2M1_FLOOR[(a * 4).long()].clamp_(max=6)  # a = 6 is index 6's upper neighbour
    lof, hif = _E2M1[lo], _E2M1[lo + 1]
    t = (a - lof) / (hif - lof)  # where a lies between its two neighbours, in [0, 1]
    if gen is None:
        up = (t > 0.5) | ((t == 0.5) & (lo % 2 == 1))  # a tie goes to the even mantissa
    else:
        up = torch.rand(a.shape, generator=gen) < t
    bits = (lo + up).to(torch.uint8)
    return torch.where(y < 0, bits | 8, bits)


def _fp8_bits(y: Tensor, gen: torch.Generator | None) -> Tensor:
    """e4m3fn bit patterns of y (|y| <= 448), nearest or stochastically rounded."""
    f8 = torch.float8_e4m3fn
    if gen is None:
        return y.to(f8).view(torch.uint8)
    a = y.abs()
    near = a.to(f8)
    nb = near.view(torch.uint8).to(torch.int16)
    nf = near.float()
    below = nf <= a  # the nearest value is the lower neighbour of a
    lo = torch.where(below, nb, nb - 1).clamp_(0, 0x7E)
    hi = torch.where(below, nb + 1, nb).clamp_(0, 0x7E)  # 0x7E is 448, 0x7F NaN
    lof = lo.to(torch.uint8).view(f8).float()
    hif = hi.to(torch.uint8).view(f8).float()
    gap = hif - lof
    p_hi = torch.where(gap > 0, (a - lof) / torch.where(gap > 0, gap, 1.0), torch.zeros_like(a))
    bits = torch.where(torch.rand(a.shape, generator=gen) < p_hi, hi, lo)
    bits = torch.where(y < 0, bits | 0x80, bits)
    return bits.to(torch.uint8)


def _dequantize(scale: Tensor, q: Tensor, vec: str, chunk: int, groups: int = 1, n: int | None = None) -> Tensor:
    """fp32 values of q (groups runs, flattened; `n` values in all when packed), inverse of `_quantize`."""
    n = q.numel() if n is None else n
    run = n // groups
    chunk = min(chunk, max(run, 1))
    v = _decoded(_unpack(q, _chunk_lens(run, chunk, groups), vec), vec).view(groups, run)
    pad = -run % chunk
    if pad:
        v = F.pad(v, (0, pad))
    v = v.reshape(-1, chunk) * scale.float()[:, None]
    v = v.view(groups, run + pad)
    return (v[:, :run] if pad else v).reshape(-1)


class _Buffer:
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
        return self.bytes[f.offset:f.offset + f.nbytes].view(_DTYPES[f.dtype])

    def has(self, param: int, role: str) -> bool:
        return (param, role) in self._fields

    def values(self, param: int, role: str) -> int:
        """Values field (param, role) stands for (packed fp4 codes: twice its bytes, about)."""
        f = self._fields[(param, role)]
        return f.values or f.count


class _Shards:
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
        self.scale_dtype = _DTYPES[SCALE_DTYPES[opts.scale_dtype]]
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
        # error feedback of the second quantization: what the owner's re-quantized average lost,
        # added to its next average (the shard's owner is the member with that rank)
        self.owner = -1
        self.residual: Tensor | None = None

    def pack(self, buf: _Buffer, weight: float) -> Tensor:
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
            v = _decoded(_unpack(m[4 + sn:4 + sn + nb], lens, self.vec), self.vec)
            acc.add_(v * scale.repeat_interleave(lens), alpha=w)
        mean = acc / total if total > 0 else acc
        feedback = error_feedback and total > 0
        if feedback:
            if self.residual is None or self.owner != j or len(self.residual) != nq:
                self.owner, self.residual = j, torch.zeros(nq)
            mean += self.residual
        out = torch.zeros(self.msg, dtype=torch.uint8)
        out[:4] = torch.tensor([total], dtype=torch.float32).view(torch.uint8)
        wire = torch.zeros(len(lens), dtype=self.scale_dtype)
        amax = torch.segment_reduce(mean.abs(), "max", lengths=lens) if nq else torch.zeros(0)
        scale = _wire_scale(amax / QMAX[self.vec], wire).repeat_interleave(lens)
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        out[4:4 + sn] = wire.view(torch.uint8)
        q = _codes(mean * inv, self.vec, gen)
        out[4 + sn:4 + sn + nb] = _pack(q, lens, self.vec)
        if feedback:
            self.residual = mean - _decoded(q, self.vec) * scale
        return out

    def unpack(self, msgs: list[Tensor], phase: Phase) -> _Buffer:
        """The averaged buffer from every shard's reduced message; its weight field holds the total."""
        buf = _Buffer(phase)
        for (scales, codes, _), m in zip(self.parts, msgs, strict=True):
            pos = 4
            for off, n in scales + codes:
                buf.bytes[off:off + n] = m[pos:pos + n]
                pos += n
        if self.weight is not None:
            buf.view(-1, "weight").copy_(msgs[0][:4].clone().view(torch.float32))
        return buf


class Compressor:
    """Per-site compressed averaging of pseudo-gradients, with error feedback and PowerSGD state."""

    def __init__(self, spec: str = "none", *, error_feedback: bool = True, decay: float = 1.0, seed: int = 0,
                 options: CodecOptions | None = None, site: int = 0):
        """`decay` scales the residual kept for the next round (1.0: classic error feedback);
        `seed` must be equal at every site (initial PowerSGD Q); `site` only decorrelates
        stochastic rounding between sites."""
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"error feedback decay must be in [0, 1], got {decay}")
        self.spec = spec
        self.options = options or CodecOptions()
        self.options.check()
        wire_plan(spec, [], self.options)  # a bad spec fails here, not in round 1
        self.error_feedback = error_feedback
        self.decay = decay
        self.seed = seed
        self._gen = torch.Generator().manual_seed(seed * 1_000_003 + site + 1) if self.options.stochastic else None
        self.plan: WirePlan | None = None
        self._residual: dict[int, Tensor] = {}
        self._q: dict[int, Tensor] = {}
        self._shard_maps: dict[int, _Shards | sparse_codec.SparseShards] = {}  # "qsum"/"ssum" phases by index: the shards for the last group size
        self._shard_state: dict[int, dict[str, Any]] = {}
        # the sparse codec's last verdict: (ranks a shard owner dropped, whether one refused the round)
        self.screened: list[Any] = [set(), False]
        self._merged: dict[int, Tensor] = {}  # the sparse codec's last average, by parameter index  # loaded shard residuals, used once the group size matches

    @property
    def sharded(self) -> bool:
        """The codec reduces shard by shard (the sparse codec): `average`, not `contributions`."""
        stages = parse_codec_spec(self.spec)
        return bool(stages) and stages[0].name == "sparse"

    # --- state -------------------------------------------------------------------------------

    def prepare(self, shapes: Sequence[tuple[int, ...]]) -> None:
        """Plan the wire and allocate residuals and Q for these parameter shapes (idempotent).

        `average` does it on first use. State loaded before it is kept (and checked against the
        shapes); call it before `state_dict()` when a loader fills tensors in place.
        """
        shapes = [tuple(int(s) for s in sh) for sh in shapes]
        if self.plan is not None:
            have = [r.shape for r in self.plan.routes]
            if have != shapes:
                raise ValueError(f"compressor planned for {len(have)} parameters {have[:3]}..., got "
                                 f"{len(shapes)} {shapes[:3]}...: parameter shapes must not change")
            return
        plan = wire_plan(self.spec, shapes, self.options)
        # state loaded before the first round (a resumed checkpoint) is kept, if it fits
        want_q = {r.index: r.cols * r.rank for r in plan.routes if r.kind == "powersgd"}
        want_e = {r.index: r.numel for r in plan.routes if self.error_feedback and _lossy(r)}
        if self._q:
            _check_sizes("PowerSGD Q", {i: t.numel() for i, t in self._q.items()}, want_q)
        if self._residual:
            _check_sizes("residual", {i: t.numel() for i, t in self._residual.items()}, want_e)
        for r in plan.routes:
            if r.index in want_q and r.index not in self._q:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + r.index)
                self._q[r.index] = torch.randn(r.cols, r.rank, generator=g)
            elif r.index in self._q:
                self._q[r.index] = self._q[r.index].reshape(r.cols, r.rank)
            if r.index in want_e and r.index not in self._residual:
                self._residual[r.index] = torch.zeros(r.numel)
        self.plan = plan

    def state_dict(self) -> dict[str, Any]:
        """This site's own state (error-feedback residuals, by parameter index): checkpoint it."""
        shards = {str(i): {"k": sh.k, "owner": sh.owner, "e": sh.residual.clone()}
                  for i, sh in self._shard_maps.items() if sh.residual is not None}
        shards.update({str(i): st for i, st in self._shard_state.items() if str(i) not in shards})
        return {"spec": self.spec, "residuals": {str(i): e.clone() for i, e in self._residual.items()},
                "shards": shards}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("spec") != self.spec:
            raise ValueError(f"compressor state is for spec {sd.get('spec')!r}, this compressor uses {self.spec!r}")
        res = {int(i): t.detach().reshape(-1).to(torch.float32).clone() for i, t in sd["residuals"].items()}
        if self.plan is not None:
            _check_sizes("residual", {i: t.numel() for i, t in res.items()}, {i: e.numel() for i, e in self._residual.items()})
        self._residual = res
        self._shard_maps = {}
        self._shard_state = {int(i): st for i, st in sd.get("shards", {}).items()}

    def global_state(self) -> dict[str, Any]:
        """State equal at every site (PowerSGD's warm-start Q): a healing site loads it from a peer."""
        return {"spec": self.spec, "q": {str(i): q.clone() for i, q in self._q.items()}}

    def load_global_state(self, gs: dict[str, Any]) -> None:
        if gs.get("spec") != self.spec:
            raise ValueError(f"global compressor state is for spec {gs.get('spec')!r}, this compressor uses {self.spec!r}")
        q = {int(i): t.detach().to(torch.float32).clone() for i, t in gs["q"].items()}
        if self.plan is not None:
            _check_sizes("PowerSGD Q", {i: t.numel() for i, t in q.items()}, {i: t.numel() for i, t in self._q.items()})
        self._q = q

    # --- the exchange ------------------------------------------------------------------------

    def contribution_norm(self, deltas: Sequence[Tensor]) -> float:
        """||Δ + e||: the norm of what `average` would encode for `deltas` (NaN or inf if non-finite)."""
        self.prepare([tuple(d.shape) for d in deltas])
        assert self.plan is not None
        sq = 0.0
        for r, d in zip(self.plan.routes, deltas, strict=True):
            x = d.detach().reshape(-1).to(torch.float32)  # as _inputs encodes it
            e = self._residual.get(r.index)
            sq += sq_sum(x + e if e is not None else x)
        return math.sqrt(sq) if sq == sq else math.nan

    def _inputs(self, deltas: Sequence[Tensor], weight: float, scale: float) -> list[Tensor]:
        """What each parameter's codec encodes: (Δ + e) * scale flat in fp32; zeros at weight 0."""
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"weight must be a finite number >= 0, got {weight}")
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a finite number > 0, got {scale}")
        self.prepare([tuple(d.shape) for d in deltas])
        plan = self.plan
        assert plan is not None
        part = weight > 0
        if part:
            for i, d in enumerate(deltas):
                # one reduction instead of a mask; the exact test only when the sum says so
                # (finite values can still overflow the sum)
                if not math.isfinite(float(d.sum())) and not bool(torch.isfinite(d).all()):
                    raise NonFiniteDelta(i, tuple(d.shape))
        xs: list[Tensor] = []
        for r, d in zip(plan.routes, deltas, strict=True):
            if not part:
                xs.append(torch.zeros(r.numel))  # a healed site's delta means nothing: send zeros
                continue
            x = d.detach().reshape(-1).to(torch.float32)
            e = self._residual.get(r.index)
            x = x + e if e is not None else x
            xs.append(x * scale if scale != 1.0 else x)
        return xs

    def _encode_first(self, xs: list[Tensor], weight: float) -> _Buffer:
        """Phase 1's buffer: dense and top-k parameters, PowerSGD's P, the weight."""
        assert self.plan is not None
        mine = _Buffer(self.plan.phases[0])
        mine.view(-1, "weight").fill_(weight)
        for r in self.plan.routes:
            x = xs[r.index]
            if r.kind == "dense":
                self._encode_vec(x, r.vec, mine, r.index, "")
            elif r.kind == "topk":
                self._encode_topk(x, r, mine)
            elif r.kind == "sparse":
                for (role, _, _), t in zip(sparse_record(r), sparse_codec.encode(x, r.block, r.k, r.vec), strict=True):
                    mine.view(r.index, role).copy_(t.reshape(-1))
            else:
                p = x.view(r.rows, r.cols) @ torch.linalg.qr(self._q[r.index], mode="reduced").Q
                self._encode_vec(p.t(), r.vec, mine, r.index, "P", r.rank)  # column by column
        return mine

    def _encode_q(self, xs: list[Tensor], p_hat: dict[int, Tensor]) -> tuple[_Buffer, dict[int, Tensor]]:
        """Phase 2's buffer, PowerSGD's Q = M^T P^ (linear in M again), and this site's own Qs."""
        assert self.plan is not None
        mine2 = _Buffer(self.plan.phases[1])
        q_own: dict[int, Tensor] = {}
        for r in self.plan.routes:
            if r.kind == "powersgd":
                q_own[r.index] = xs[r.index].view(r.rows, r.cols).t() @ p_hat[r.index]
                self._encode_vec(q_own[r.index].t(), r.vec, mine2, r.index, "Q", r.rank)
        return mine2, q_own

    def _own_q(self, r: Route, q_own: dict[int, Tensor], mine2: _Buffer) -> Tensor:
        """This site's Q as the others decode it (rows x rank)."""
        if r.vec == "raw":
            return q_own[r.index]
        return self._decode_vec(r.vec, mine2, r.index, "Q", r.rank).view(r.rank, r.cols).t()

    def _feedback(self, xs: list[Tensor], own: dict[int, Tensor]) -> None:
        for i, dec in own.items():
            self._residual[i] = (xs[i] - dec).mul_(self.decay) if self.decay != 1.0 else xs[i] - dec

    def average(self, deltas: Sequence[Tensor], comm: Comm, weight: float = 1.0, scale: float = 1.0,
                rank_weights: Sequence[float] | None = None, norm_ratio: float = 0.0) -> tuple[list[Tensor], WireStats]:
        """Weighted average over the group of every site's compressed `deltas` (fp32, same shapes).

        `scale` multiplies this site's contribution (Δ + e) before encoding: a clipped site's
        excess is dropped, not carried to the next round in the residual. The sparse codec's shard
        owners weigh rank i by `rank_weights[i]` (agreed by every site) instead of what its message
        claims, and screen by `norm_ratio` (trainer.sparse_codec.SparseShards); their verdict is
        left in `screened`.
        """
        xs = self._inputs(deltas, weight, scale)
        plan = self.plan
        assert plan is not None
        part = weight > 0
        stats = WireStats(bytes_sent=0, bytes_recv=0, dense=4 * sum(r.numel for r in plan.routes))
        cost = [Fraction(0)]
        self.screened = [set(), False]

        def exchange(buf: _Buffer) -> list[_Buffer]:
            n, op = buf.phase.nbytes, buf.phase.op
            stats.payload += n
            stats.collectives += 1
            if op == "sum":
                cost[0] += wire_cost(op, n, comm.size)
                comm.allreduce_sum(buf.wire)
                return [buf]
            if op == "gather":
                cost[0] += wire_cost(op, n, comm.size)
                return [_Buffer(buf.phase, t) for t in comm.allgather(buf.wire)]
            if comm.size == 1:  # nothing to average; the buffer still passes the comm (async mode captures it)
                return [_Buffer(buf.phase, comm.allgather(buf.wire)[0])]
            sh = self._shards(plan.phases.index(buf.phase), comm.size)
            stats.collectives += 1  # all-to-all, then all-gather
            if isinstance(sh, sparse_codec.SparseShards):
                cost[0] += (comm.size - 1) * (sh.msg + sh.msg_out)
                mine = sh.reduce(comm.alltoall(sh.pack(buf.bytes, weight)), comm.rank, self.error_feedback,
                                 rank_weights, norm_ratio)
                self._merged, total, *self.screened = sh.unpack(comm.allgather(mine))
                merged = _Buffer(buf.phase)
                merged.view(-1, "weight").fill_(total)
                return [merged]
            cost[0] += 2 * (comm.size - 1) * sh.msg
            mine = sh.reduce(comm.alltoall(sh.pack(buf, weight)), comm.rank, self._gen, self.error_feedback)
            return [sh.unpack(comm.allgather(mine), buf.phase)]

        out: list[Tensor | None] = [None] * len(plan.routes)
        own: dict[int, Tensor] = {}  # what this site's contribution decodes to (residuals)

        # phase 1: dense and top-k parameters, PowerSGD's P
        mine = self._encode_first(xs, weight)
        _apply_weight(mine, weight)
        got = exchange(mine)
        weights = [float(b.view(-1, "weight")) for b in got]
        total = sum(weights)
        if not total > 0:
            raise ValueError("no participating site in this round (the weights sum to 0)")
        p_hat: dict[int, Tensor] = {}
        for r in plan.routes:
            if r.kind == "powersgd":
                p = self._mean(got, weights, total, lambda b, r=r: self._decode_vec(r.vec, b, r.index, "P", r.rank))
                p_hat[r.index] = torch.linalg.qr(p.view(r.rank, r.rows).t(), mode="reduced").Q
                continue
            if r.kind == "sparse":  # averaged shard by shard already (a group of one: its own records)
                out[r.index] = (self._merged[r.index] if comm.size > 1 else self._decode_sparse(got[0], r)).view(r.shape)
                if part and r.index in self._residual:
                    own[r.index] = self._decode_sparse(mine, r)
                continue
            if r.kind == "topk":
                out[r.index] = self._topk_mean(got, weights, r).view(r.shape)
                if part and r.index in self._residual:
                    own[r.index] = self._decode_topk(mine, r)
                continue
            decode = lambda b, r=r: self._decode_vec(r.vec, b, r.index, "")  # noqa: E731
            out[r.index] = self._mean(got, weights, total, decode).view(r.shape)
            if part and r.index in self._residual:
                own[r.index] = decode(mine)

        # phase 2: PowerSGD's Q = M^T P^, linear in M again
        if len(plan.phases) > 1:
            mine2, q_own = self._encode_q(xs, p_hat)
            _apply_weight(mine2, weight)
            got2 = exchange(mine2)
            for r in plan.routes:
                if r.kind != "powersgd":
                    continue
                i = r.index
                q = self._mean(got2, weights, total, lambda b, r=r: self._decode_vec(r.vec, b, r.index, "Q", r.rank))
                q = q.view(r.rank, r.cols).t().contiguous()
                out[i] = (p_hat[i] @ q.t()).view(r.shape)
                self._q[i] = q  # the warm start, equal at every site
                if part and i in self._residual:
                    own[i] = (p_hat[i] @ self._own_q(r, q_own, mine2).t()).view(-1)

        self._feedback(xs, own)
        stats.bytes_sent = stats.bytes_recv = math.floor(cost[0])
        return out, stats  # type: ignore[return-value]

    def contributions(self, deltas: Sequence[Tensor], comm: Comm, weight: float = 1.0,
                      scale: float = 1.0) -> tuple[list[Tensor], list[float], WireStats]:
        """Every member's contribution as this site decodes it from the bytes it received:
        (one flat fp32 vector per rank, parameters concatenated; each rank's weight; stats).

        Every phase is all-gathered whole (no summing on the way, no shard owner), so no member's
        result depends on another member's arithmetic: what a robust aggregator (trainer.aggregate)
        needs, at (K-1)/(2(K-1)/K) = K/2 times a ring all-reduce's bytes. PowerSGD's P^ is the mean of
        the finite Ps; each site's contribution is P^ Q_k^T.
        """
        xs = self._inputs(deltas, weight, scale)
        plan = self.plan
        assert plan is not None
        part = weight > 0
        stats = WireStats(bytes_sent=0, bytes_recv=0, dense=4 * sum(r.numel for r in plan.routes))
        cost = Fraction(0)

        def gather(buf: _Buffer) -> list[_Buffer]:
            nonlocal cost
            stats.payload += buf.phase.nbytes
            stats.collectives += 1
            cost += wire_cost("gather", buf.phase.nbytes, comm.size)
            return [_Buffer(buf.phase, t) for t in comm.allgather(buf.wire)]

        mine = self._encode_first(xs, weight)
        got = gather(mine)
        weights = [float(b.view(-1, "weight")) for b in got]
        joined = [1.0 if w > 0 else 0.0 for w in weights]  # what P^ and Q average over: who takes part
        per: list[list[Tensor | None]] = [[None] * len(plan.routes) for _ in got]
        own: dict[int, Tensor] = {}
        p_hat: dict[int, Tensor] = {}
        for r in plan.routes:
            if r.kind == "powersgd":
                ps = [self._decode_vec(r.vec, b, r.index, "P", r.rank) for b in got]
                p_hat[r.index] = torch.linalg.qr(_finite_mean(ps, joined).view(r.rank, r.rows).t(), mode="reduced").Q
                continue
            dec = (lambda b, r=r: self._decode_topk(b, r)) if r.kind == "topk" else \
                (lambda b, r=r: self._decode_sparse(b, r)) if r.kind == "sparse" else \
                (lambda b, r=r: self._decode_vec(r.vec, b, r.index, ""))
            for k, b in enumerate(got):
                per[k][r.index] = dec(b).reshape(-1).float()
            if part and r.index in self._residual:
                own[r.index] = per[comm.rank][r.index]  # type: ignore[assignment]
        if len(plan.phases) > 1:
            mine2, q_own = self._encode_q(xs, p_hat)
            got2 = gather(mine2)
            for r in plan.routes:
                if r.kind != "powersgd":
                    continue
                i = r.index
                qs = [self._decode_vec(r.vec, b, i, "Q", r.rank).view(r.rank, r.cols).t() for b in got2]
                for k, q in enumerate(qs):
                    per[k][i] = (p_hat[i] @ q.t()).reshape(-1)
                self._q[i] = _finite_mean(qs, joined).contiguous()  # the warm start, equal at every site
                if part and i in self._residual:
                    own[i] = (p_hat[i] @ self._own_q(r, q_own, mine2).t()).view(-1)
        self._feedback(xs, own)
        stats.bytes_sent = stats.bytes_recv = math.floor(cost)
        return [_joined(p) for p in per], weights, stats  # type: ignore[arg-type]

    # --- per-parameter codecs ----------------------------------------------------------------

    def _encode_vec(self, x: Tensor, vec: str, buf: _Buffer, i: int, prefix: str, groups: int = 1) -> None:
        """Encode x (flattened as `groups` runs of equal length) into field `prefix` of param i."""
        p = f"{prefix}." if prefix else ""
        if vec == "raw":
            buf.view(i, f"{p}raw").copy_(x.reshape(-1))
        else:
            _quantize(x.reshape(groups, -1), vec, self.options, self._gen, buf.view(i, f"{p}scale"), buf.view(i, f"{p}q"))

    def _decode_vec(self, vec: str, buf: _Buffer, i: int, prefix: str, groups: int = 1) -> Tensor:
        p = f"{prefix}." if prefix else ""
        if vec == "raw":
            return buf.view(i, f"{p}raw")
        return _dequantize(buf.view(i, f"{p}scale"), buf.view(i, f"{p}q"), vec, self.options.chunk, groups,
                           buf.values(i, f"{p}q"))

    def _encode_topk(self, x: Tensor, r: Route, buf: _Buffer) -> None:
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
        self._encode_vec(vals, r.vec, buf, r.index, "values")

    def _topk_sent(self, buf: _Buffer, r: Route) -> tuple[Tensor, Tensor]:
        """(flat positions, values) of what a top-k buffer carries, values that decode to 0 left
        out: they say nothing, and block padding (zeros past r.numel) is among them."""
        vals = self._decode_vec(r.vec, buf, r.index, "values")
        idx = buf.view(r.index, "index").long()
        if r.block:
            base = torch.arange(r.blocks, dtype=torch.long)[:, None] * r.block
            idx = ((idx + _OFFSET16).view(r.blocks, r.k) + base).view(-1)
        keep = vals != 0
        return idx[keep], vals[keep]

    @staticmethod
    def _decode_sparse(buf: _Buffer, r: Route) -> Tensor:
        pos, vals = sparse_codec.decode(*sparse_codec.route_records(buf.bytes, buf.phase, r), r.block, r.k, r.vec, r.numel)
        return torch.zeros(r.numel).index_put_((pos,), vals)

    def _decode_topk(self, buf: _Buffer, r: Route) -> Tensor:
        idx, vals = self._topk_sent(buf, r)
        return torch.zeros(r.numel).index_put_((idx,), vals)

    def _topk_mean(self, bufs: list[_Buffer], weights: list[float], r: Route) -> Tensor:
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
            idx, vals = self._topk_sent(b, r)  # sparse: no dense pass per site
            acc.index_add_(0, idx, vals, alpha=w)
            count.index_add_(0, idx, torch.full_like(vals, w))
        return torch.where(count > 0, acc / count.clamp(min=1e-30), 0.0)

    def _shards(self, index: int, k: int) -> _Shards | sparse_codec.SparseShards:
        sh = self._shard_maps.get(index)
        if sh is None or sh.k != k:  # a new group size re-cuts the shards; the old residual goes
            assert self.plan is not None
            phase = self.plan.phases[index]
            sh = self._shard_maps[index] = sparse_codec.SparseShards(phase, self.plan.routes, k, self.options) \
                if phase.op == "ssum" else _Shards(phase, k, self.options)
            saved = self._shard_state.pop(index, None)
            if saved is not None and int(saved["k"]) == k:
                sh.owner, sh.residual = int(saved["owner"]), saved["e"].detach().reshape(-1).float().clone()
        return sh

    @staticmethod
    def _mean(bufs: list[_Buffer], weights: list[float], total: float, decode) -> Tensor:
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


def _joined(parts: list[Tensor]) -> Tensor:
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


def split_flat(flat: Tensor, shapes: Sequence[Sequence[int]]) -> list[Tensor]:
    """`flat` cut into private tensors of these shapes, in order."""
    out, pos = [], 0
    for s in shapes:
        n = math.prod(s)
        out.append(flat[pos:pos + n].view(tuple(s)).clone())
        pos += n
    return out


def _finite_mean(xs: list[Tensor], weights: list[float]) -> Tensor:
    """Weighted mean of the finite tensors among `xs` whose weight is > 0 (zeros if there are none):
    one site's NaN must not poison what every site shares (PowerSGD's P^ and Q)."""
    kept = [(x, w) for x, w in zip(xs, weights, strict=True) if w > 0 and bool(torch.isfinite(x).all())]
    if not kept:
        return torch.zeros_like(xs[0])
    return sum(x * w for x, w in kept) / sum(w for _, w in kept)


def _lossy(r: Route) -> bool:
    return r.kind != "dense" or r.vec != "raw"


def _apply_weight(buf: _Buffer, weight: float) -> None:
    # summed buffers carry weight * contribution; gathered ones are weighted by the receiver
    if buf.phase.op == "sum" and weight != 1.0:
        w = buf.view(-1, "weight").clone() if buf.has(-1, "weight") else None
        buf.wire.mul_(weight)
        if w is not None:
            buf.view(-1, "weight").copy_(w)


def _check_sizes(what: str, got: dict[int, int], want: dict[int, int]) -> None:
    if got != want:
        raise ValueError(f"{what} state does not fit the parameters: sizes {sorted(got.items())[:4]}... "
                         f"vs expected {sorted(want.items())[:4]}...")


__all__ = ["CodecOptions", "Compressor", "NonFiniteDelta", "WireStats", "payload_bytes", "split_flat", "wire_cost"]
