"""Robust aggregation of the sites' pseudo-gradients: what `[diloco] aggregate` names.

Every rule works on the contributions as received (one flat fp32 vector per kept site, decoded
from the bytes that site sent), so nothing a site says about itself enters the result. The rules:

- `mean`: the plain mean (DiLoCo). One liar moves it without bound; kept for 2 sites, where no rule
  can tell the liar from the honest site (trainer/outer/guard.py refuses to commit instead), and for top-k
  codecs, whose sites send different coordinates.
- `median`: coordinate-wise median (Yin et al., arXiv 1803.01498). Tolerates up to half liars, but
  throws away most of the honest sites' averaging.
- `trimmed`: coordinate-wise trimmed mean, dropping the `trim` largest and smallest values of each
  coordinate (1803.01498); trim = (K-1)//2 is the median.
- `clip`: centered clipping (Karimireddy et al., arXiv 2012.10333) around the coordinate-wise
  median: x̄ = c + mean_k clip(x_k - c, τ), τ = clip_ratio x the median distance to c. Honest sites
  inside τ are averaged exactly (no cost when nobody lies); a liar moves the result by at most τ/K.
- `filter`: the mean of the contributions near the coordinate-wise median c: a contribution farther
  from c than clip_ratio x the median distance, or pointing away from it (cosine < 0), is dropped.
  Honest sites are close together (in the simulator their distances to c are within 0.8-1.15x of
  the median, their cosines to c 0.8-0.97), so nobody honest is dropped and the result is the plain
  mean; a sign flip or a scaled update lands far outside and costs nothing; a liar inside the
  bound (ALIE, slow drift) moves the mean by at most clip_ratio x the honest spread / K.

`auto` resolves by the number of sites and the codec (`resolve`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

RULES = ("mean", "median", "trimmed", "clip", "filter")
CLIP_ITERATIONS = 2  # re-centre on the clipped mean this many times (2012.10333 uses 1-3)


@dataclass(kw_only=True, slots=True)
class Aggregated:
    avg: Tensor  # the aggregate, flat fp32
    scales: list[float]  # per row: the factor its deviation was scaled by (1: as sent, 0: dropped)
    reasons: list[str] = field(default_factory=list)  # per row: why it was scaled or dropped ("": it was not)


def resolve(rule: str, sites: int, sparse: bool) -> str:
    """The rule `auto` stands for: filter from 3 sites on (dense codecs), else mean."""
    if rule != "auto":
        return rule
    return "filter" if sites >= 3 and not sparse else "mean"


def default_trim(k: int) -> int:
    """Values dropped at each end of a coordinate: the most liars a majority of honest sites outvotes."""
    return max((k - 1) // 2, 0)


def coordinate_median(xs: Tensor) -> Tensor:
    """Median of each column of `xs` (K x N); the mean of the two middle values when K is even."""
    s = xs.sort(dim=0).values
    k = xs.shape[0]
    return s[k // 2] if k % 2 else (s[k // 2 - 1] + s[k // 2]) / 2


def trimmed_mean(xs: Tensor, trim: int) -> Tensor:
    k = xs.shape[0]
    trim = min(trim, (k - 1) // 2)
    return xs.sort(dim=0).values[trim:k - trim].mean(0)


def centered_clip(xs: Tensor, ratio: float) -> tuple[Tensor, list[float]]:
    """Centered clipping around the coordinate median; (aggregate, each row's clip factor)."""
    c = coordinate_median(xs)
    scales = [1.0] * xs.shape[0]
    for _ in range(CLIP_ITERATIONS):
        dev = xs - c
        dist = dev.double().pow(2).sum(1).sqrt()
        tau = ratio * float(dist.median()) if xs.shape[0] > 2 else float(dist.max())
        f = torch.where(dist > tau, tau / dist.clamp(min=1e-30), torch.ones_like(dist))
        scales = f.tolist()
        c = c + (dev * f.to(dev.dtype)[:, None]).mean(0)
    return c, scales


def near_median(xs: Tensor, ratio: float, weights: Tensor | None = None) -> tuple[Tensor, list[float], list[str]]:
    """The mean of the rows near the coordinate median; (aggregate, 1/0 per row, reasons)."""
    c = coordinate_median(xs).double()
    x64 = xs.double()
    dist = (x64 - c).pow(2).sum(1).sqrt()
    bound = ratio * float(dist.median())
    cos = (x64 @ c) / (x64.pow(2).sum(1).sqrt() * c.norm()).clamp(min=1e-300)
    reasons = []
    for d, cs in zip(dist.tolist(), cos.tolist(), strict=True):
        if d > bound:
            reasons.append(f"{d:.4g} from the sites' coordinate median, over {bound:.4g} ({ratio:g}x their median "
                           f"distance): dropped")
        elif cs < 0:
            reasons.append(f"points away from the sites' coordinate median (cosine {cs:.3f}): dropped")
        else:
            reasons.append("")
    keep = [i for i, r in enumerate(reasons) if not r]
    return _mean(xs[keep], weights[keep] if weights is not None else None), [0.0 if r else 1.0 for r in reasons], reasons


def _mean(xs: Tensor, weights: Tensor | None) -> Tensor:
    """The rows' mean, weighted by `weights` (one per row) when given."""
    if weights is None:
        return xs.mean(0)
    w = weights.to(xs.dtype)
    return (xs * w[:, None]).sum(0) / w.sum()


def sparse_mean(xs: Tensor, weights: Tensor | None = None) -> Tensor:
    """Each coordinate's mean over the rows that hold a value there (top-k: over its senders)."""
    if weights is None:
        count = (xs != 0).sum(0)
        return torch.where(count > 0, xs.sum(0) / count.clamp(min=1), 0.0)
    w = weights.to(xs.dtype)[:, None]
    share = ((xs != 0) * w).sum(0)
    return torch.where(share > 0, (xs * w).sum(0) / share.clamp(min=1e-30), 0.0)


def aggregate(xs: Tensor, rule: str, *, trim: int = -1, clip_ratio: float = 2.0,
              sparse: Sequence[slice] = (), weights: Tensor | None = None) -> Aggregated:
    """Combine the kept sites' contributions (`xs`, K x N, finite) by `rule`.

    `sparse`: column ranges (top-k parameters) the mean takes over the sites that sent a value.
    `weights`: each row's share (tokens it trained, trainer.outer.guard.token_weights), used by the rules
    that average rows (mean, filter); median, trimmed and clip are coordinate statistics and ignore it.
    """
    k = xs.shape[0]
    if rule == "mean" or k <= 2:
        avg = _mean(xs, weights)
        for sl in sparse:
            avg[sl] = sparse_mean(xs[:, sl], weights)
        return Aggregated(avg=avg, scales=[1.0] * k)
    if rule == "median":
        return Aggregated(avg=coordinate_median(xs), scales=[1.0] * k)
    if rule == "trimmed":
        return Aggregated(avg=trimmed_mean(xs, default_trim(k) if trim < 0 else trim), scales=[1.0] * k)
    if rule == "clip":
        avg, scales = centered_clip(xs, clip_ratio)
        return Aggregated(avg=avg, scales=scales, reasons=[
            f"deviation from the sites' median clipped to {f:.0%} (clip_ratio {clip_ratio:g})" if f < 1 else ""
            for f in scales])
    if rule == "filter":
        avg, scales, reasons = near_median(xs, clip_ratio, weights)
        return Aggregated(avg=avg, scales=scales, reasons=reasons)
    raise ValueError(f"unknown aggregation rule {rule!r}; one of {', '.join(RULES)}")
