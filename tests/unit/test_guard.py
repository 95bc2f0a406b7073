"""Screening of the sites' pseudo-gradients before they reach θ (trainer/guard.py)."""

from __future__ import annotations

import math
import time

import pytest
import torch

from trainer.comm import ThreadComm, run_sites
from trainer.compression import Compressor
from trainer.guard import average_bound, decode_name, encode_name, guarded_average, screen

SHAPES = [(16, 8), (8,)]


def honest(k: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 100 + k)
    return [torch.randn(s, generator=g) * 0.01 for s in SHAPES]


def run_round(deltas, spec="none", ratio=3.0, max_norm=0.0, lie=None):
    """One guarded average over ThreadComm sites; `lie`: rank whose reported norm is divided by 1000."""
    k = len(deltas)
    comps = [Compressor(spec, error_feedback=False, seed=0, site=i) for i in range(k)]
    if lie is not None:
        real = comps[lie].contribution_norm
        comps[lie].contribution_norm = lambda ds: real(ds) / 1000  # type: ignore[method-assign]
    return run_sites(ThreadComm.group(k), lambda r, comm: guarded_average(
        comps[r], deltas[r], comm, 1.0, f"site{r}", ratio, max_norm))


def norm(ts) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in ts))


def test_screen_drops_non_finite_and_clips_outliers_against_the_others():
    v = screen([1, 1, 1], [1.0, math.nan, 1.2], 3.0, 0.0)
    assert [x.scale for x in v] == [1.0, 0.0, 1.0] and "non-finite" in v[1].reason
    v = screen([1, 1, 1], [1.0, 100.0, 1.2], 3.0, 0.0)
    assert v[0].scale == 1.0 and v[2].scale == 1.0  # the outlier does not make the others look small
    assert v[1].scale == 0.0 and "over 3.3 (3x the other sites' median): dropped" in v[1].reason
    assert screen([1, 1, 1], [1.0, 3.2, 1.2], 3.0, 0.0)[1].scale == 1.0  # 3.2 <= 3 x 1.1
    # two sites: each is compared with the other
    v = screen([1, 1], [1.0, 100.0], 3.0, 0.0)
    assert v[0].scale == 1.0 and v[1].scale == 0.0
    # the absolute bound; a non-participating site (weight 0) is left alone; ratio 0 is off
    v = screen([1, 0, 1], [5.0, math.inf, 1.0], 0.0, 2.0)
    assert v[0].scale == pytest.approx(0.4) and v[1].scale == 1.0 and v[2].scale == 1.0
    assert all(x.scale == 1.0 for x in screen([1, 1], [1.0, 100.0], 0.0, 0.0))


def test_average_bound_is_the_root_of_the_squared_sent_norms():
    v = screen([1, 1, 1], [3.0, 4.0, math.nan], 0.0, 0.0)
    assert average_bound([1, 1, 1], [3.0, 4.0, math.nan], v) == pytest.approx(1.25 * 5.0)


def test_site_names_ride_in_the_gathered_row():
    assert decode_name(torch.tensor(encode_name("dc-eu/west 1"), dtype=torch.float64)) == "dc-eu/west 1"
    assert len(decode_name(torch.tensor(encode_name("é" * 100), dtype=torch.float64)).encode()) <= 64


@pytest.mark.parametrize("spec", ["none", "int8"])
def test_a_nan_site_is_dropped_and_theta_stays_finite(spec):
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


def test_a_100x_site_is_dropped_and_a_configured_bound_clips():
    deltas = [honest(k) for k in range(3)]
    deltas[2] = [d * 100 for d in deltas[2]]
    out = run_round(deltas)
    expect = [(deltas[0][i] + deltas[1][i]) / 2 for i in range(2)]
    for g in out:
        assert g.k_active == 2 and [s for s, _ in g.rejected] == ["site2"]
        for a, b in zip(g.avg, expect, strict=True):
            assert torch.allclose(a, b, atol=1e-7)
    unguarded = run_round(deltas, ratio=0.0)[0].avg
    assert norm(unguarded) > 10 * norm(out[0].avg)
    cap = norm(deltas[0]) / 2  # every honest site over the absolute bound: each is clipped to it
    out = run_round([honest(k) for k in range(3)], ratio=0.0, max_norm=cap)
    assert out[0].k_active == 3 and len(out[0].rejected) == 3 and "clipped" in out[0].rejected[0][1]
    assert norm(out[0].avg) <= cap * (1 + 1e-6)


def test_a_site_that_sends_more_than_it_reports_fails_the_round_everywhere():
    deltas = [honest(k) for k in range(3)]
    liar = [honest(0), [d * 1000 for d in honest(1)], honest(2)]  # reports the norm of honest(1)
    out = run_round(liar, lie=1)
    assert all(g.avg is None and "sent other values than it reported" in g.failed for g in out)
    assert all(not g.failed and g.avg is not None for g in run_round(deltas))  # honest: no false alarm


def test_the_row_gather_and_the_average_are_timed_apart():
    k = 2
    comms = ThreadComm.group(k)
    for c in comms:  # a slow gathered row (a far Lighthouse-side peer), a fast payload
        real = c.allgather
        c.allgather = lambda t, real=real: (time.sleep(0.3), real(t))[1]  # type: ignore[method-assign]
    comps = [Compressor("none", error_feedback=False, seed=0, site=i) for i in range(k)]
    deltas = [[torch.full((64,), 0.1 * (i + 1))] for i in range(k)]
    got = run_sites(comms, lambda r, comm: guarded_average(comps[r], deltas[r], comm, 1.0, f"site{r}", 3.0, 0.0))
    for g in got:
        assert g.weight_s >= 0.3 and g.payload_s > 0 and g.payload_s < g.weight_s, (g.weight_s, g.payload_s)
    # nobody contributes: the row is gathered, no average is taken
    none = run_sites(ThreadComm.group(k), lambda r, comm: guarded_average(
        comps[r], deltas[r], comm, 0.0, f"site{r}", 3.0, 0.0))
    assert all(g.avg is None and g.weight_s > 0 and g.payload_s == 0.0 for g in none)
