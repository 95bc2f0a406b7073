"""Screening and robust aggregation of the sites' pseudo-gradients (trainer/outer/guard.py, trainer/outer/aggregate.py).

The attacks are issue 34's, found against a20f7d3: a guard that believed each site's reported
weight and norm let one liar of three move θ against the honest direction.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from trainer.codecs.compression import Compressor
from trainer.collectives import ThreadComm, run_sites
from trainer.outer.aggregate import aggregate, coordinate_median, resolve, trimmed_mean
from trainer.outer.guard import GuardRule, decode_name, encode_name, guarded_average

SHAPES = [(16, 8), (8,)]


def honest(k: int, seed: int = 0) -> list[torch.Tensor]:
    """Site k's pseudo-gradient: a direction all honest sites share, plus the site's own noise."""
    common = torch.Generator().manual_seed(seed)
    own = torch.Generator().manual_seed(seed * 100 + k + 1)
    return [(torch.randn(s, generator=common) + 0.7 * torch.randn(s, generator=own)) * 0.01 for s in SHAPES]


class Liar(Compressor):
    """Sends what `send` makes of its honest input, at the codec's own encoding (no local checks)."""

    def __init__(self, spec, send, **kw):
        super().__init__(spec, **kw)
        self.send = send

    def _inputs(self, deltas, weight, scale):
        xs = super()._inputs(deltas, weight, scale)
        return [self.send(x) for x in xs]


def run_round(deltas, spec="none", rule=None, liars=None, weights=None, comms=None):
    """One guarded round over ThreadComm sites; `liars`: rank -> send function; `weights`: claimed."""
    k = len(deltas)
    liars = liars or {}
    comps = [Liar(spec, liars[i], error_feedback=False, seed=0, site=i) if i in liars
             else Compressor(spec, error_feedback=False, seed=0, site=i) for i in range(k)]
    rule = rule or GuardRule(aggregate=resolve("auto", k, False))
    return run_sites(comms or ThreadComm.group(k), lambda r, comm: guarded_average(
        comps[r], deltas[r], comm, weights[r] if weights else 1.0, f"site{r}", rule))


def norm(ts) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in ts))


def flat(ts) -> torch.Tensor:
    return torch.cat([t.reshape(-1).double() for t in ts])


def honest_mean(deltas, ranks):
    return [sum(deltas[k][i] for k in ranks) / len(ranks) for i in range(len(SHAPES))]


def along(avg, deltas, ranks) -> float:
    """The average's component along the honest mean, in units of the honest mean (honest: 1)."""
    h = flat(honest_mean(deltas, ranks))
    return float(flat(avg) @ h / (h @ h))


def test_coordinate_rules_on_known_values():
    xs = torch.tensor([[1.0, -5.0], [2.0, 0.0], [30.0, 1.0], [4.0, 2.0]])
    assert coordinate_median(xs).tolist() == [3.0, 0.5]
    assert trimmed_mean(xs, 1).tolist() == [3.0, 0.5]
    assert coordinate_median(xs[:3]).tolist() == [2.0, 0.0]
    honest3 = torch.tensor([[1.0, 1.0], [1.2, 0.9], [0.9, 1.1]])
    assert torch.allclose(aggregate(honest3, "clip").avg, honest3.mean(0))  # nobody clipped: the mean
    assert resolve("auto", 2, False) == "mean" and resolve("auto", 3, False) == "filter"
    assert resolve("auto", 5, True) == "mean" and resolve("median", 2, False) == "median"


def test_site_names_ride_in_the_gathered_row():
    assert decode_name(torch.tensor(encode_name("dc-eu/west 1"), dtype=torch.float64)) == "dc-eu/west 1"
    assert len(decode_name(torch.tensor(encode_name("é" * 100), dtype=torch.float64)).encode()) <= 64


@pytest.mark.parametrize("spec", ["none", "int8"])
def test_a_site_that_finds_its_own_nan_sends_nothing_and_the_others_go_on(spec):
    deltas = [honest(k) for k in range(3)]
    deltas[1] = [torch.full(s, math.nan) for s in SHAPES]
    out = run_round(deltas, spec)
    for g in out:
        assert g.k_active == 2 and not g.failed
        assert g.rejected == [("site1", g.rejected[0][1])] and "non-finite" in g.rejected[0][1]
        assert all(torch.isfinite(a).all() for a in g.avg)
    clean = run_round([deltas[0], deltas[2]], spec)[0].avg  # what the two honest sites average to
    for a, b in zip(out[0].avg, clean, strict=True):
        assert torch.allclose(a, b, atol=1e-3 if spec == "int8" else 1e-7)


@pytest.mark.parametrize("spec", ["none", "int8", "powersgd:2"])
def test_a_liar_sending_nan_bytes_under_weight_1_is_dropped(spec):
    deltas = [honest(k) for k in range(3)]
    out = run_round(deltas, spec, liars={2: lambda x: torch.full_like(x, math.nan)})
    for g in out:
        assert g.avg is not None and all(torch.isfinite(a).all() for a in g.avg), g.failed
        assert [s for s, _ in g.rejected] == ["site2"] and "non-finite" in g.rejected[0][1]


@pytest.mark.parametrize("spec", ["none", "int8"])
def test_weight_lie_with_a_sign_flipped_2_9x_update_does_not_move_theta_backwards(spec):
    # a20f7d3: weight 1e6 and -2.9x the honest norm moved θ to -2.90 along the honest direction
    deltas = [honest(k) for k in range(3)]
    out = run_round(deltas, spec, liars={2: lambda x: -2.9 * x}, weights=[1.0, 1.0, 1e6])
    for g in out:
        assert ("site2", "weight 1e+06 claimed; a site's weight is 0 or 1: dropped") in g.rejected
        assert g.k_active == 2
        assert along(g.avg, deltas, [0, 1]) == pytest.approx(1.0, abs=0.02)
    # the same flip at weight 1 is centered-clipped: the result stays on the honest side
    g = run_round(deltas, spec, liars={2: lambda x: -2.9 * x})[0]
    assert along(g.avg, deltas, [0, 1]) > 0.5


def test_a_norm_can_no_longer_be_lied_about_a_14x_flip_is_dropped():
    # a20f7d3: reporting a norm of 2.99 while sending -14x was committed (-4.07); norms are now
    # computed from the bytes received
    deltas = [honest(k) for k in range(3)]
    for g in run_round(deltas, liars={1: lambda x: -14 * x}):
        assert [s for s, _ in g.rejected] == ["site1"] and "over" in g.rejected[0][1]
        assert along(g.avg, deltas, [0, 2]) == pytest.approx(1.0, abs=0.02)


def test_a_plain_sign_flip_at_honest_size_is_dropped_by_the_default_rule():
    deltas = [honest(k) for k in range(4)]
    for g in run_round(deltas, liars={3: lambda x: -x}):
        assert g.k_active == 3 and [s for s, _ in g.rejected] == ["site3"] and "filter" in g.rejected[0][1]
        assert along(g.avg, deltas, [0, 1, 2]) == pytest.approx(1.0, abs=1e-6)  # the honest sites' mean
    mean_rule = run_round(deltas, rule=GuardRule(aggregate="mean"), liars={3: lambda x: -x})[0]
    assert along(mean_rule.avg, deltas, [0, 1, 2]) < 0.6  # what the plain mean let through
    # centered clipping bounds the flip's pull; median and trimmed mean ignore it
    for rule in ("clip", "median", "trimmed"):
        g = run_round(deltas, rule=GuardRule(aggregate=rule), liars={3: lambda x: -x})[0]
        assert along(g.avg, deltas, [0, 1, 2]) > 0.6, rule


def test_nobody_honest_is_dropped_by_the_default_rule():
    for seed in range(5):
        deltas = [honest(k, seed) for k in range(5)]
        g = run_round(deltas)[0]
        assert g.k_active == 5 and g.rejected == []
        assert along(g.avg, deltas, range(5)) == pytest.approx(1.0, abs=1e-6)


def test_two_sites_that_disagree_are_refused_not_guessed():
    # a20f7d3: with 2 sites a liar reporting a norm of 1e-9 got the honest site dropped and blamed
    deltas = [honest(k) for k in range(2)]
    for send, words in [(lambda x: 10 * x, "norms differ"), (lambda x: -x, "point apart")]:
        for g in run_round(deltas, liars={1: send}):
            assert g.avg is None and g.k_active == 0 and words in g.failed
            assert "site0 and site1" in g.failed and g.rejected == []
    assert all(g.avg is not None and not g.failed for g in run_round(deltas))  # honest: committed


def test_two_honest_sites_that_barely_agree_are_committed():
    """Late in a run two honest sites' pseudo-gradients are near orthogonal (lab, H 1210: cosine -0.04 to
    -0.2); a bound of 0 refused 3 of 4 such rounds, each costing both sites their round."""
    a = honest(0)
    b = [x.clone() for x in honest(1)]
    fa, fb = flat(a), flat(b)
    fb -= (fa @ fb / (fa @ fa) + 0.15 * fb.norm() / fa.norm()) * fa  # cosine about -0.2
    i = 0
    for t in b:
        t.copy_(fb[i:i + t.numel()].view_as(t))
        i += t.numel()
    cos = float(flat(a) @ flat(b) / flat(a).norm() / flat(b).norm())
    assert -0.25 < cos < -0.1
    from trainer.rules.config import from_dict
    rule = GuardRule.of(from_dict({"diloco": {"sites": 2}}).diloco)
    assert all(g.avg is not None and not g.failed and g.k_active == 2 for g in run_round([a, b], rule=rule))
    assert all("point apart" in g.failed for g in run_round([a, b], rule=GuardRule(aggregate="mean", min_cosine=0.0)))


def test_a_100x_site_is_dropped_and_a_configured_bound_clips():
    deltas = [honest(k) for k in range(3)]
    deltas[2] = [d * 100 for d in deltas[2]]
    out = run_round(deltas)
    expect = [(deltas[0][i] + deltas[1][i]) / 2 for i in range(2)]
    for g in out:
        assert g.k_active == 2 and [s for s, _ in g.rejected] == ["site2"]
        for a, b in zip(g.avg, expect, strict=True):
            assert torch.allclose(a, b, atol=1e-7)
    unguarded = run_round(deltas, rule=GuardRule(aggregate="mean", norm_ratio=0.0))[0].avg
    assert norm(unguarded) > 10 * norm(out[0].avg)
    cap = norm(honest(0)) / 2  # every honest site over the absolute bound: each is clipped to it
    out = run_round([honest(k) for k in range(3)], rule=GuardRule(aggregate="mean", norm_ratio=0.0, max_norm=cap))
    assert out[0].k_active == 3 and len(out[0].rejected) == 3 and "clipped by the site" in out[0].rejected[0][1]
    assert norm(out[0].avg) <= cap * (1 + 1e-6)


def test_a_site_sending_different_bytes_to_different_peers_gets_the_round_refused_everywhere():
    deltas = [honest(k) for k in range(3)]
    comms = ThreadComm.group(3)
    real = comms[0].allgather

    def equivocated(t):  # what site 0 receives from site 2 is not what site 1 receives
        got = real(t)
        if t.dtype != torch.float64 and t.numel() > 32:  # the payload, not the row or the digest
            got[2] = got[2] * 0.5
        return got
    comms[0].allgather = equivocated  # type: ignore[method-assign]
    for g in run_round(deltas, comms=comms):
        assert g.avg is None and "different bytes to different peers" in g.failed
    assert all(g.avg is not None for g in run_round(deltas))


def test_the_row_gather_and_the_average_are_timed_apart():
    k = 2
    comms = ThreadComm.group(k)
    for c in comms:  # a slow gathered row (a far Lighthouse-side peer), a fast payload
        real = c.allgather
        c.allgather = lambda t, real=real: (time.sleep(0.3 if t.dtype == torch.float64 else 0), real(t))[1]  # type: ignore[method-assign]
    comps = [Compressor("none", error_feedback=False, seed=0, site=i) for i in range(k)]
    deltas = [[torch.full((64,), 0.1 * (i + 1))] for i in range(k)]
    rule = GuardRule()
    got = run_sites(comms, lambda r, comm: guarded_average(comps[r], deltas[r], comm, 1.0, f"site{r}", rule))
    for g in got:
        assert g.weight_s >= 0.3 and g.payload_s > 0 and g.payload_s < g.weight_s, (g.weight_s, g.payload_s)
    # nobody contributes: the row is gathered, no average is taken
    none = run_sites(ThreadComm.group(k), lambda r, comm: guarded_average(
        comps[r], deltas[r], comm, 0.0, f"site{r}", rule))
    assert all(g.avg is None and g.weight_s > 0 and g.payload_s == 0.0 for g in none)
