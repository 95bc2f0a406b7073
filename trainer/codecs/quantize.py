"""The quantizers of the codec chains: fp32 values <-> int8, fp8 (e4m3fn) or fp4 (e2m1) codes.

A run of values is cut into chunks of `CodecOptions.chunk`; each chunk gets one scale (max |x| /
127, or / 448 for e4m3fn, or / 6 for e2m1, sent as fp32, fp16 or bf16 and rounded up so it never
clips) and one code per value, round-to-nearest or stochastically rounded. fp4 (e2m1: magnitudes
0, 0.5, 1, 1.5, 2, 3, 4, 6) packs two codes a byte, the first in the low half; every chunk starts
on a fresh byte (ceil(len/2) bytes). The Compressor (trainer.codecs.compression) writes these into its
wire buffers (trainer.codecs.wire_buffer); the shard owners of a quantized average (trainer.codecs.quant_shards)
decode, average and re-quantize with them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from trainer.rules.codec_spec import PACKED, QMAX, CodecOptions


def wire_scale(scale: Tensor, out: Tensor) -> Tensor:
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


def to_codes(y: Tensor, vec: str, gen: torch.Generator | None) -> Tensor:
    """One code per scaled value y: int8 (|y| <= 127), e4m3fn bits (|y| <= 448) or e2m1 bits (|y| <= 6)."""
    if vec == "int8":
        y = torch.floor(y + torch.rand(y.shape, generator=gen)) if gen is not None else torch.round(y)
        return y.clamp_(-127, 127).to(torch.int8)
    if vec == "fp4":
        return _fp4_bits(y.clamp_(-6.0, 6.0), gen)
    return _fp8_bits(y.clamp_(-448.0, 448.0), gen)


def from_codes(codes: Tensor, vec: str) -> Tensor:
    """fp32 values of one-per-value codes (int8 or uint8 storage), inverse of `to_codes` (unscaled)."""
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


def pack(codes: Tensor, lens: Tensor, vec: str) -> Tensor:
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


def unpack(b: Tensor, lens: Tensor, vec: str) -> Tensor:
    """One code per value from wire bytes `b`, inverse of `pack`."""
    per = PACKED.get(vec, 1)
    if per == 1:
        return b
    bits = 8 // per
    b = b.view(torch.uint8)
    slots = torch.stack([(b >> (bits * j)) & ((1 << bits) - 1) for j in range(per)], dim=1).view(-1)
    used = _slots(lens, per)
    return slots if used is None else slots[used]


def quantize(x: Tensor, vec: str, opts: CodecOptions, gen: torch.Generator | None,
             scale_out: Tensor, q_out: Tensor) -> None:
    """Quantize the rows of x (groups x run) in chunks that stay inside a row."""
    groups, run = x.shape
    chunk = min(opts.chunk, max(run, 1))
    pad = -run % chunk
    xp = (F.pad(x, (0, pad)) if pad else x).reshape(-1, chunk)
    scale = wire_scale(xp.abs().amax(dim=1) / QMAX[vec], scale_out)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = to_codes(xp * inv[:, None], vec, gen).view(groups, run + pad)
    q = (q[:, :run] if pad else q).reshape(-1)
    q_out.copy_(pack(q, _chunk_lens(run, chunk, groups), vec).view(q_out.dtype))


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


def dequantize(scale: Tensor, q: Tensor, vec: str, chunk: int, groups: int = 1, n: int | None = None) -> Tensor:
    """fp32 values of q (groups runs, flattened; `n` values in all when packed), inverse of `quantize`."""
    n = q.numel() if n is None else n
    run = n // groups
    chunk = min(chunk, max(run, 1))
    v = from_codes(unpack(q, _chunk_lens(run, chunk, groups), vec), vec).view(groups, run)
    pad = -run % chunk
    if pad:
        v = F.pad(v, (0, pad))
    v = v.reshape(-1, chunk) * scale.float()[:, None]
    v = v.view(groups, run + pad)
    return (v[:, :run] if pad else v).reshape(-1)
