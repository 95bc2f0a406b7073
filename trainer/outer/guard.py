"""Screening and robust aggregation of the sites' pseudo-gradients (sync and overlap modes).

Nothing a site says about its own contribution is believed. Every site all-gathers every other
site's encoded contribution (trainer.codecs.compression.Compressor.contributions), decodes it itself and
decides from what it received; every honest site receives the same bytes, so all take the same
decisions:

- a weight other than 0 or 1 is a lie (the quorum gives each site one vote): that site is dropped;
- a non-finite contribution is dropped for the round (the other sites' progress is kept: rolling
  back would let one broken site stall the run); a site that finds its own Δ non-finite says so
  and sends weight 0;
- norms are computed from the bytes received. From 3 sites on, a norm over `guard_norm_ratio` x
  the median of the OTHER sites' norms is dropped; over `guard_max_norm` it is scaled down to it;
- the rest is combined by `diloco.aggregate` (trainer.outer.aggregate; by default from 3 sites on, the
  mean of the contributions near their coordinate-wise median);
- with exactly 2 contributions nobody can tell the liar from the honest site: if their norms differ
  by more than `guard_norm_ratio`, or their directions disagree (cosine under `guard_min_cosine`),
  the round is not committed, and the event names both sites instead of guessing;
- sites that trained different numbers of tokens in the round (`h_policy = "time"`) are averaged
  by tokens (`merge_weighting`, `token_weights`): a claim that is not a finite positive number drops
  the site's contribution; one over guard_norm_ratio x the median of the other claims counts as that;
- from 3 sites on, every site checks that all decoded the same average (a SHA-256 digest gathered
  after it): a site that sent different bytes to different peers gets the round refused everywhere.

Each decision is an event naming the site and the round.
"""

from __future__ import annotations

import hashlib
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from trainer.codecs.compression import Compressor, split_flat
from trainer.codecs.norms import dot, sq_sum
from trainer.codecs.phase_exchange import WireStats
from trainer.collectives import Comm
from trainer.outer.aggregate import aggregate, resolve

NAME_BYTES = 64  # a site's name travels in the gathered row, truncated to this many UTF-8 bytes
CLIP_EVENT = 0.5  # centered clipping scaling a site's deviation below this is reported as an event


@dataclass(kw_only=True, slots=True)
class GuardRule:
    """What the guard enforces; trainer.rules.diloco_config.DilocoConfig documents each knob."""

    aggregate: str = "mean"  # resolved rule (trainer.outer.aggregate.RULES)
    norm_ratio: float = 3.0
    max_norm: float = 0.0
    min_cosine: float = -0.5
    clip_ratio: float = 2.0
    trim: int = -1
    merge_tokens: bool = False  # weigh the average by the tokens each site trained (merge_weighting "tokens")

    @classmethod
    def of(cls, d, sparse: bool = False) -> GuardRule:
        """The rule a DilocoConfig sets; `sparse`: the codec is top-k (no coordinate-wise rules)."""
        return cls(aggregate=resolve(d.aggregate, d.sites, sparse), norm_ratio=d.guard_norm_ratio,
                   max_norm=d.guard_max_norm, min_cosine=d.guard_min_cosine,
                   clip_ratio=d.aggregate_clip_ratio, trim=d.aggregate_trim,
                   merge_tokens=d.merge_weighting == "tokens")


def encode_name(name: str) -> list[float]:
    """A site name as NAME_BYTES // 8 float64 values (their bytes), to ride in a gathered row."""
    raw = name.encode("utf-8")[:NAME_BYTES].ljust(NAME_BYTES, b"\0")
    return torch.frombuffer(bytearray(raw), dtype=torch.float64).tolist()


def decode_name(values: Tensor) -> str:
    raw = values.to(torch.float64).contiguous().numpy().tobytes()
    return raw.rstrip(b"\0").decode("utf-8", "replace")


@dataclass(kw_only=True, slots=True)
class GuardedAverage:
    avg: list[Tensor] | None  # Δ̄; None: nobody contributed, or the round was refused
    stats: WireStats | None
    k_active: int  # sites whose contribution the average holds (dropped sites not counted)
    weights: list[float]  # each member's weight, by rank
    rows: list[Tensor]  # each member's gathered `extra` values, by rank
    names: list[str]  # each member's site name, by rank
    rejected: list[tuple[str, str]]  # (site, reason) for every contribution not kept as sent
    failed: str = ""  # why the round was refused ("" when it was not)
    weight_s: float = 0.0  # seconds of the gathered row's all-gather
    payload_s: float = 0.0  # seconds of the contributions' all-gather and the aggregation
    tokens: list[float] = field(default_factory=list)  # each member's claimed tokens of the round, by rank


@dataclass(kw_only=True, slots=True)
class Screened:
    kept: list[int]  # ranks whose contribution goes into the aggregate
    scales: dict[int, float]  # rank -> factor its contribution was scaled by (guard_max_norm)
    rejected: list[tuple[int, str]]  # (rank, reason)
    failed: str = ""


def screen(weights: Sequence[float], own: Sequence[float], xs: Sequence[Tensor], names: Sequence[str],
           rule: GuardRule) -> Screened:
    """Which received contributions to keep, from what was received only; equal at every site.

    `own`: what each site says it did to itself (0: found its Δ non-finite; < 1: clipped it to
    guard_max_norm). It can only lower a site's own contribution, so it is safe to believe."""
    out = Screened(kept=[], scales={}, rejected=[])
    norms: dict[int, float] = {}
    for k, (w, x) in enumerate(zip(weights, xs, strict=True)):
        if w == 1 and own[k] < 1:
            out.rejected.append((k, f"norm over diloco.guard_max_norm {rule.max_norm:.4g}: clipped by the site"))
        if w == 0:
            if own[k] == 0:
                out.rejected.append((k, "non-finite pseudo-gradient (found by the site itself): sent nothing"))
            continue
        if w != 1:
            out.rejected.append((k, f"weight {w:.4g} claimed; a site's weight is 0 or 1: dropped"))
            continue
        n = math.sqrt(sq_sum(x))
        if not math.isfinite(n):
            out.rejected.append((k, f"non-finite pseudo-gradient (norm {n}): dropped"))
            continue
        norms[k] = n
    if len(norms) >= 3 and rule.norm_ratio > 0:
        for k, n in list(norms.items()):
            bound = rule.norm_ratio * statistics.median(m for j, m in norms.items() if j != k)
            if n > bound:
                out.rejected.append((k, f"norm {n:.4g} over {bound:.4g} ({rule.norm_ratio:g}x the other sites' "
                                        f"median): dropped"))
        norms = {k: n for k, n in norms.items() if k not in {j for j, _ in out.rejected}}
    for k, n in norms.items():
        if rule.max_norm > 0 and n > rule.max_norm * (1 + 1e-5):  # not a self-clipped site's rounding
            out.scales[k] = rule.max_norm / n
            out.rejected.append((k, f"norm {n:.4g} over diloco.guard_max_norm {rule.max_norm:.4g}: clipped"))
            norms[k] = rule.max_norm
    out.kept = sorted(norms)
    if len(out.kept) == 2:
        out.failed = _two_sites_disagree(out.kept, norms, xs, names, rule)
    return out


def _two_sites_disagree(kept: list[int], norms: dict[int, float], xs: Sequence[Tensor], names: Sequence[str],
                        rule: GuardRule) -> str:
    a, b = kept
    pair = f"{names[a]} and {names[b]}"
    lo, hi = sorted((norms[a], norms[b]))
    if rule.norm_ratio > 0 and hi > rule.norm_ratio * lo:
        return (f"the two contributions' norms differ {hi / max(lo, 1e-30):.3g}x (over {rule.norm_ratio:g}x): "
                f"with two sites the liar among {pair} cannot be told; not committed")
    cos = dot(xs[a], xs[b]) / max(norms[a] * norms[b], 1e-300)
    if cos < rule.min_cosine:
        return (f"the two contributions point apart (cosine {cos:.3f} < {rule.min_cosine:g}): with two sites the "
                f"liar among {pair} cannot be told; not committed")
    return ""


def token_weights(claims: Sequence[float], kept: Sequence[int],
                  cap_ratio: float) -> tuple[list[int], Tensor | None, list[tuple[int, str]]]:
    """Each kept rank's share of the average from the tokens it says it trained this round.

    Returns (the ranks still kept; their weights, or None when their claims are all equal: the plain
    mean, unchanged; (rank, reason) for each claim not taken as made). A site trains what its window
    allows, so a claim is bounded by `cap_ratio` x the median of the OTHER kept sites' claims (a site
    never raises its own bound); a claim that is not a finite positive number drops its contribution.
    """
    if all(claims[k] == claims[kept[0]] for k in kept):  # NaN is equal to nothing, so never passes here
        return list(kept), None, []
    notes = [(k, f"claimed {claims[k]!r} tokens for the round; must be a finite number > 0: dropped")
             for k in kept if not (math.isfinite(claims[k]) and claims[k] > 0)]
    good = [k for k in kept if k not in {j for j, _ in notes}]
    if len({claims[k] for k in good}) <= 1:
        return good, None, notes
    out = []
    for k in good:
        w = claims[k]
        others = [claims[j] for j in good if j != k]
        bound = cap_ratio * statistics.median(others) if cap_ratio > 0 else math.inf
        if w > bound:
            notes.append((k, f"claimed {w:.4g} tokens, over {bound:.4g} ({cap_ratio:g}x the other sites' median): "
                             f"counted as {bound:.4g}"))
            w = bound
        out.append(w)
    return good, torch.tensor(out, dtype=torch.float64), notes


def _sparse_columns(comp: Compressor) -> list[slice]:
    """Column ranges of top-k and sparse parameters in the concatenated contribution."""
    assert comp.plan is not None
    out, pos = [], 0
    for r in sorted(comp.plan.routes, key=lambda r: r.index):
        if r.kind in ("topk", "sparse"):
            out.append(slice(pos, pos + r.numel))
        pos += r.numel
    return out


def _digest(data: bytes) -> Tensor:
    return torch.frombuffer(bytearray(hashlib.sha256(data).digest()), dtype=torch.uint8)


def _sharded_average(comp: Compressor, deltas: list[Tensor], comm: Comm, weight: float, scale: float,
                     got: list[Tensor], rule: GuardRule, res: GuardedAverage) -> GuardedAverage:
    """The sparse codec's exchange: no site sees every contribution, each shard's owner screens its
    shard (trainer.codecs.sparse_codec.SparseShards). The weights come from the gathered rows, equal at
    every site: a claimed weight other than 0 or 1 drops the site, tokens weigh the rest."""
    names = res.names
    res.weights = [float(g[0]) for g in got]
    kept = []
    for k, g in enumerate(got):
        w, own = float(g[0]), float(g[1])
        if w == 1 and own < 1:
            res.rejected.append((names[k], f"norm over diloco.guard_max_norm {rule.max_norm:.4g}: clipped by the site"))
        if w == 0 and own == 0:
            res.rejected.append((names[k], "non-finite pseudo-gradient (found by the site itself): sent nothing"))
        elif w not in (0.0, 1.0):
            res.rejected.append((names[k], f"weight {w:.4g} claimed; a site's weight is 0 or 1: dropped"))
        elif w == 1:
            kept.append(k)
    rank_w = [0.0] * len(got)
    ranks, tw = kept, None
    if rule.merge_tokens:
        ranks, tw, notes = token_weights(res.tokens, kept, rule.norm_ratio)
        res.rejected += [(names[k], why) for k, why in notes]
    for i, k in enumerate(ranks):
        rank_w[k] = float(tw[i]) if tw is not None else 1.0
    t0 = time.perf_counter()
    if not any(w > 0 for w in rank_w):
        res.failed = "no contribution left after screening; not committed"
        return res
    avg, res.stats = comp.average(deltas, comm, weight, scale, rank_weights=rank_w, norm_ratio=rule.norm_ratio)
    dropped, refused = comp.screened
    res.rejected += [(names[k], f"a shard's norm over {rule.norm_ratio:g}x the other sites' median, or "
                                f"non-finite: dropped by the shard's owner") for k in sorted(dropped) if k < len(names)]
    res.k_active = sum(1 for k, w in enumerate(rank_w) if w > 0 and k not in dropped)
    if refused:
        res.failed = (f"two sites' contributions differ in norm by more than {rule.norm_ratio:g}x and nobody can "
                      f"tell which is honest: {', '.join(names[k] for k in ranks)}; not committed")
    if comm.size >= 3:  # as below: an owner that sent different merged bytes to different peers
        flat = torch.cat([a.reshape(-1) for a in avg])
        digests = comm.allgather(_digest(flat.numpy().tobytes()))
        if any(not torch.equal(d, digests[comm.rank]) for d in digests):
            res.failed = ("the sites decoded different averages: a participant sent different bytes to "
                          "different peers; not committed")
    if res.failed:
        res.k_active = 0
    else:
        res.avg = avg
    res.payload_s = time.perf_counter() - t0
    return res


def guarded_average(comp: Compressor, deltas: list[Tensor], comm: Comm, weight: float, site: str,
                    rule: GuardRule, extra: Sequence[float] = (), tokens: float = 0.0) -> GuardedAverage:
    """Gather (weight, broken flag, tokens, extra, name) and every contribution; screen; aggregate; cross-check.

    `tokens`: what this site trained in the round (with rule.merge_tokens, the average weighs by it)."""
    broken, scale = False, 1.0
    if weight > 0:
        own = comp.contribution_norm(deltas)
        if not math.isfinite(own):
            broken, weight = True, 0.0  # say so, send zeros: the others keep their progress
        elif rule.max_norm > 0 and own > rule.max_norm:
            scale = rule.max_norm / own  # the excess is dropped here, not carried in the residual
    # the second value is what the site did to itself: 0 found its own Δ non-finite, < 1 clipped it
    row = torch.tensor([weight, 0.0 if broken else scale, tokens, *extra, *encode_name(site)], dtype=torch.float64)
    t0 = time.perf_counter()
    got = comm.allgather(row)
    weight_s = time.perf_counter() - t0
    n_extra = len(extra)
    names = [decode_name(g[3 + n_extra:]) for g in got]
    res = GuardedAverage(avg=None, stats=None, k_active=0, weights=[], tokens=[float(g[2]) for g in got],
                         rows=[g[3:3 + n_extra] for g in got], names=names, rejected=[], weight_s=weight_s)
    if not any(float(g[0]) > 0 for g in got):
        res.weights = [float(g[0]) for g in got]
        return res  # nobody contributes this round (every site healing): no payload exchange
    if comp.sharded:
        return _sharded_average(comp, deltas, comm, weight, scale, got, rule, res)
    t0 = time.perf_counter()
    xs, weights, res.stats = comp.contributions(deltas, comm, weight, scale)
    res.weights = weights  # as received with the payload (the row's may differ for a liar)
    sc = screen(weights, [float(g[1]) for g in got], xs, names, rule)
    res.rejected = [(names[k], why) for k, why in sc.rejected]
    res.k_active = len(sc.kept)
    avg, kept = None, None
    if sc.failed:
        res.failed = sc.failed
    elif sc.kept:
        ranks, tw = sc.kept, None
        if rule.merge_tokens:
            ranks, tw, notes = token_weights(res.tokens, sc.kept, rule.norm_ratio)
            res.rejected += [(names[k], why) for k, why in notes]
        res.k_active = len(ranks)
        kept = torch.stack([xs[k] * sc.scales[k] if k in sc.scales else xs[k] for k in ranks]) if ranks else None
    if kept is not None:
        agg = aggregate(kept, rule.aggregate, trim=rule.trim, clip_ratio=rule.clip_ratio, sparse=_sparse_columns(comp),
                        weights=tw)
        res.rejected += [(names[k], f"{rule.aggregate}: {why}") for k, s, why in
                         zip(ranks, agg.scales, agg.reasons or [""] * len(ranks), strict=True)
                         if why and (s == 0 or s < CLIP_EVENT)]
        res.k_active = sum(1 for s in agg.scales if s > 0)
        avg = agg.avg
    if comm.size >= 3:  # every member makes this call, whatever it decided, so none waits alone
        digests = comm.allgather(_digest(avg.numpy().tobytes() if avg is not None else sc.failed.encode()))
        if any(not torch.equal(d, digests[comm.rank]) for d in digests):
            res.failed = ("the sites decoded different averages: a participant sent different bytes to "
                          "different peers; not committed")
    if res.failed:
        res.k_active = 0
    elif avg is not None:
        res.avg = split_flat(avg, [d.shape for d in deltas])
    res.payload_s = time.perf_counter() - t0
    return res
