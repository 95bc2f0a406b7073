"""trainer.codecs.norms: fp64-accurate sums of squares and dots at fp32 speed, never fooled by range."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.codecs.norms import BLOCK, dot, sq_sum, sq_sum_all


def _exact_sq(x: torch.Tensor) -> float:
    return float(x.double().pow(2).sum())


@pytest.mark.parametrize("n", [1, BLOCK - 1, BLOCK, 3 * BLOCK + 17])
@pytest.mark.parametrize("scale", [1e-12, 1e-3, 1.0, 1e6])
def test_matches_fp64_over_lengths_and_scales(n, scale):
    g = torch.Generator().manual_seed(n)
    x, y = torch.randn(n, generator=g) * scale, torch.randn(n, generator=g) * scale
    assert sq_sum(x) == pytest.approx(_exact_sq(x), rel=1e-6)
    assert dot(x, y) == pytest.approx(float(x.double() @ y.double()), abs=1e-6 * math.sqrt(_exact_sq(x) * _exact_sq(y)))


def test_huge_or_tiny_finite_values_keep_their_norm():
    # fp32 squares of 1e20 overflow and of 1e-25 underflow: the fp64 sum is taken, so a huge but
    # finite pseudo-gradient is clipped by the guard, not called non-finite, and a tiny one is not zero
    for v in (1e20, 3e38, 1e-25, 1e-44):
        x = torch.full((BLOCK + 5,), v)
        assert sq_sum(x) == pytest.approx(_exact_sq(x), rel=1e-6) and 0 < sq_sum(x) < math.inf
        assert dot(x, x) == pytest.approx(_exact_sq(x), rel=1e-6)


def test_non_finite_values_read_as_such():
    x = torch.ones(BLOCK * 2)
    x[7] = math.nan
    assert math.isnan(sq_sum(x)) and math.isnan(dot(x, torch.ones_like(x)))
    x[7] = math.inf
    assert sq_sum(x) == math.inf
    assert sq_sum(torch.zeros(10)) == 0.0 and dot(torch.zeros(10), torch.ones(10)) == 0.0


def test_several_tensors_and_other_dtypes():
    a, b = torch.ones(3, 4), torch.full((5,), 2.0, dtype=torch.float64)
    assert sq_sum_all([a, b]) == 12 + 20
    assert sq_sum(torch.ones(4, dtype=torch.bfloat16)) == 4
