"""Screening each site's pseudo-gradient before it can reach θ (sync and overlap modes).

Every site reports the norm of what it is about to send (Δ plus its error-feedback residual) with
its weight. From the same gathered numbers every site takes the same decisions:

- a non-finite contribution is dropped for the round (weight 0); the other sites' progress is kept,
  since rolling the round back would let one broken site stall the run;
- a norm above `guard_norm_ratio` x the median of the OTHER sites' norms is dropped too: its
  direction may be honest, but clipped to 3x it still cost 6% ppl in the simulator when one of
  three sites sent 100x every third round, dropped 0.1% (BENCHMARKS.md, guard);
- a norm above `guard_max_norm` is clipped to it (the site scales what it sends);
- after the average, its norm must stay within what the reported norms allow. A site that reports
  one norm and sends more (or NaN) fails this check at every site: the round is not committed.

Each decision is an event naming the site and the round.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.comm import Comm
from trainer.compression import Compressor, WireStats

NAME_BYTES = 64  # a site's name travels in the gathered row, truncated to this many UTF-8 bytes
# decoded averages may exceed the sent norms by the codecs' rounding (fp8: up to 1/16 per value)
AVERAGE_TOLERANCE = 1.25


@dataclass(kw_only=True, slots=True)
class Verdict:
    scale: float  # what the site multiplies its contribution by: 1 kept, 0 dropped, else clipped
    reason: str = ""  # why it was not kept as sent ("" when it was)


def screen(weights: Sequence[float], norms: Sequence[float], ratio: float, max_norm: float) -> list[Verdict]:
    """One verdict per site from the gathered (weight, norm) pairs; equal at every site.

    `ratio` 0 turns the comparison with the other sites off, `max_norm` 0 the absolute bound.
    """
    out = []
    for k, (w, n) in enumerate(zip(weights, norms, strict=True)):
        if w <= 0:
            out.append(Verdict(scale=1.0))
            continue
        if not math.isfinite(n):
            out.append(Verdict(scale=0.0, reason=f"non-finite pseudo-gradient (norm {n})"))
            continue
        others = [m for j, (v, m) in enumerate(zip(weights, norms, strict=True))
                  if j != k and v > 0 and math.isfinite(m)]
        outlier = ratio * statistics.median(others) if ratio > 0 and others else math.inf
        if n > outlier:
            out.append(Verdict(scale=0.0, reason=f"norm {n:.4g} over {outlier:.4g} ({ratio:g}x the other sites' "
                                                 f"median): dropped"))
        elif max_norm > 0 and n > max_norm:
            out.append(Verdict(scale=max_norm / n, reason=f"norm {n:.4g} over diloco.guard_max_norm "
                                                          f"{max_norm:.4g}: clipped"))
        else:
            out.append(Verdict(scale=1.0))
    return out


def average_bound(weights: Sequence[float], norms: Sequence[float], verdicts: Sequence[Verdict]) -> float:
    """The largest norm the average can have if every site sent what it reported.

    Each coordinate of a weighted mean (or of top-k's mean over the sites that sent it) is at most
    the largest of the sites' values there, so ||mean|| <= sqrt(sum of the squared sent norms).
    """
    sq = sum((v.scale * n) ** 2 for w, n, v in zip(weights, norms, verdicts, strict=True)
             if w > 0 and v.scale > 0)
    return AVERAGE_TOLERANCE * math.sqrt(sq) + 1e-12


def encode_name(name: str) -> list[float]:
    """A site name as NAME_BYTES // 8 float64 values (their bytes), to ride in a gathered row."""
    raw = name.encode("utf-8")[:NAME_BYTES].ljust(NAME_BYTES, b"\0")
    return torch.frombuffer(bytearray(raw), dtype=torch.float64).tolist()


def decode_name(values: Tensor) -> str:
    raw = values.to(torch.float64).contiguous().numpy().tobytes()
    return raw.rstrip(b"\0").decode("utf-8", "replace")


@dataclass(kw_only=True, slots=True)
class GuardedAverage:
    avg: list[Tensor] | None  # Δ̄; None: nobody contributed, or the average failed its check
    stats: WireStats | None
    k_active: int  # sites whose contribution the average holds (dropped sites not counted)
    weights: list[float]  # each member's weight, by rank
    rows: list[Tensor]  # each member's gathered `extra` values, by rank
    names: list[str]  # each member's site name, by rank
    rejected: list[tuple[str, str]]  # (site, reason) for every contribution not kept as sent
    failed: str = ""  # why the average itself was refused ("" when it was not)
    weight_s: float = 0.0  # seconds of the gathered row's all-gather
    payload_s: float = 0.0  # seconds of the average (0 when every contribution was dropped)


def guarded_average(comp: Compressor, deltas: list[Tensor], comm: Comm, weight: float, site: str,
                    ratio: float, max_norm: float, extra: Sequence[float] = ()) -> GuardedAverage:
    """Gather (weight, norm, name, extra) from every member, screen, average, check the average."""
    norm = comp.contribution_norm(deltas) if weight > 0 else 0.0
    row = torch.tensor([weight, norm, *extra, *encode_name(site)], dtype=torch.float64)
    t0 = time.perf_counter()
    got = comm.allgather(row)
    weight_s = time.perf_counter() - t0
    n_extra = len(extra)
    weights = [float(g[0]) for g in got]
    norms = [float(g[1]) for g in got]
    names = [decode_name(g[2 + n_extra:]) for g in got]
    verdicts = screen(weights, norms, ratio, max_norm)
    rejected = [(names[k], v.reason) for k, v in enumerate(verdicts) if v.reason]
    kept = [w for w, v in zip(weights, verdicts, strict=True) if w > 0 and v.scale > 0]
    res = GuardedAverage(avg=None, stats=None, k_active=len(kept), weights=weights, rows=[g[2:2 + n_extra] for g in got],
                         names=names, rejected=rejected, weight_s=weight_s)
    if not kept:
        return res
    mine = verdicts[comm.rank]
    w = weight if mine.scale > 0 else 0.0
    t0 = time.perf_counter()
    res.avg, res.stats = comp.average(deltas, comm, w, scale=mine.scale if w > 0 else 1.0)
    res.payload_s = time.perf_counter() - t0
    got_norm = math.sqrt(sum(float(a.double().pow(2).sum()) for a in res.avg))
    bound = average_bound(weights, norms, verdicts)
    if not got_norm <= bound:
        res.failed = (f"average norm {got_norm:.4g} over {bound:.4g}, the most the reported norms allow: "
                      f"a site sent other values than it reported")
        res.avg = None
    return res
