"""The divergence watch: rising or non-finite validation perplexity."""

from __future__ import annotations

import math

from trainer.divergence import DivergenceWatch, safe_exp


def test_three_rises_in_a_row_raise_once_per_streak():
    w = DivergenceWatch(3)
    seen = [w.observe(r, p) for r, p in enumerate([10.0, 8.0, 9.0, 7.5, 8.0, 8.5, 9.0, 9.5, 6.0], start=1)]
    hits = [(r, d) for r, d in enumerate(seen, start=1) if d]
    assert [r for r, _ in hits] == [7]  # 7.5 -> 8.0 -> 8.5 -> 9.0; the 4th rise (9.5) does not repeat it
    assert hits[0][1].best_round == 4 and hits[0][1].best_ppl == 7.5
    assert "rose 3 evaluations in a row, to 9 at round 7 (best 7.5 at round 4)" in hits[0][1].message


def test_a_non_finite_perplexity_is_reported_at_once_and_zero_watches_nothing():
    w = DivergenceWatch(3)
    assert w.observe(1, 5.0) is None
    d = w.observe(2, math.inf)
    assert d is not None and d.best_round == 1 and "inf at round 2" in d.message
    assert DivergenceWatch(3).observe(1, math.nan) is not None
    off = DivergenceWatch(0)
    assert all(off.observe(r, p) is None for r, p in enumerate([1.0, 2.0, 3.0, 4.0, math.nan]))


def test_safe_exp_does_not_raise_on_a_huge_loss():
    assert safe_exp(1000.0) == math.inf and safe_exp(0.0) == 1.0
