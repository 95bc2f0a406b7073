"""Sums of squares and dot products of large fp32 vectors, to fp64's precision at fp32's speed.

The guard takes every contribution's norm, and with two sites their dot, in the exchange itself; a
copy to fp64 first (`x.double().pow(2).sum()`) costs ~110 ms per 10.8M-element vector on one core,
about 0.6 s of a small-preset round's sync on the lab's window-limited link (BENCHMARKS.md, "The
whole round on the wire"). Summing fp32 products over blocks of 2^12 and the blocks' sums in fp64
gives the same figure to ~1e-7 relative in ~3 ms (a dot in 10 ms). Where fp32 could overflow or
underflow (a sum outside [1e-30, 1e30]), the exact fp64 sum is taken instead, so a huge but finite
vector never reads as non-finite. The result depends on the bytes only, so every site gets the same.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

BLOCK = 1 << 12  # elements summed in fp32 before the fp64 total: ~1e-7 relative at most per block
DOT_BLOCK = 1 << 14  # elements of one BLAS dot: fewer calls, its fp32 sum still short
SAFE = (1e-30, 1e30)  # fp32 partial sums inside this range neither overflow nor lose mass to underflow


def _blocks(x: Tensor) -> tuple[Tensor, Tensor]:
    m = x.numel() // BLOCK * BLOCK
    return x[:m].view(-1, BLOCK), x[m:]


def sq_sum(x: Tensor) -> float:
    """sum(x**2) of a flat float tensor, to ~1e-7 relative; NaN or inf where x holds them."""
    x = x.detach().reshape(-1).to(torch.float32)
    head, tail = _blocks(x)
    s = float(torch.linalg.vector_norm(head, dim=1).double().pow(2).sum() + tail.double().pow(2).sum())
    if SAFE[0] < s < SAFE[1] or s == 0.0 and not bool(x.any()) or math.isnan(s):
        return s
    return float(x.double().pow(2).sum())


def sq_sum_all(xs: list[Tensor]) -> float:
    """sum(x**2) over several tensors."""
    return sum(sq_sum(x) for x in xs)


def dot(a: Tensor, b: Tensor) -> float:
    """a . b of two flat float tensors of one length, to ~1e-7 of |a||b|."""
    a, b = a.detach().reshape(-1).to(torch.float32), b.detach().reshape(-1).to(torch.float32)
    # BLAS dots of DOT_BLOCK elements (a row-wise product of BLOCK-wide rows is 3x slower: it is not BLAS)
    parts = [torch.dot(x, y) for x, y in zip(a.split(DOT_BLOCK), b.split(DOT_BLOCK), strict=True)]
    s = float(torch.stack(parts).double().sum()) if parts else 0.0
    if SAFE[0] < abs(s) < SAFE[1] or math.isnan(s):
        return s
    return float(a.double() @ b.double())
