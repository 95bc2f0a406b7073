"""Heterogeneous sites (issue 36): token-weighted merging and the "time" round policy.

A site that trained fewer tokens (a slower site under h_policy "time") counts for less in the
average; what a site says about its own tokens is bounded by the others' claims, and a claim that is
not a finite positive number drops its contribution.
"""

from __future__ import annotations

import math

import pytest
import torch

from trainer.codecs.compression import Compressor
from trainer.collectives import ThreadComm, run_sites
from trainer.modes.ft_exchange import agreed_window
from trainer.outer.aggregate import aggregate
from trainer.outer.guard import GuardRule, guarded_average, token_weights
from trainer.rules.config import from_dict
from trainer.rules.tables import ConfigError

SHAPES = [(16, 8), (8,)]


def deltas(k: int) -> list[torch.Tensor]:
    common, own = torch.Generator().manual_seed(0), torch.Generator().manual_seed(k + 1)
    return [(torch.randn(s, generator=common) + 0.5 * torch.randn(s, generator=own)) * 0.01 for s in SHAPES]


def merge(tokens: list[float], rule: str = "filter", merge_tokens: bool = True):
    k = len(tokens)
    comps = [Compressor("none", error_feedback=False, seed=0, site=i) for i in range(k)]
    rule_ = GuardRule(aggregate=rule, merge_tokens=merge_tokens)
    return run_sites(ThreadComm.group(k), lambda r, comm: guarded_average(
        comps[r], deltas(r), comm, 1.0, f"site{r}", rule_, tokens=tokens[r]))


def flat(ts) -> torch.Tensor:
    return torch.cat([t.reshape(-1).double() for t in ts])


def weighted(ws: list[float]) -> torch.Tensor:
    return sum(w * flat(deltas(k)) for k, w in enumerate(ws)) / sum(ws)


def test_sites_that_trained_fewer_tokens_count_for_less():
    got = merge([1000.0, 1000.0, 500.0])
    assert all(torch.equal(flat(g.avg), flat(got[0].avg)) for g in got)  # every site the same θ
    assert torch.allclose(flat(got[0].avg), weighted([2, 2, 1]), atol=1e-7)
    assert not torch.allclose(flat(got[0].avg), weighted([1, 1, 1]), atol=1e-5)
    assert got[0].k_active == 3 and got[0].rejected == []


def test_equal_claims_leave_the_plain_mean_bit_for_bit():
    same = merge([640.0, 640.0, 640.0])
    plain = merge([640.0, 640.0, 640.0], merge_tokens=False)
    assert torch.equal(flat(same[0].avg), flat(plain[0].avg))


def test_equal_weighting_ignores_the_claims():
    got = merge([1000.0, 1000.0, 500.0], merge_tokens=False)
    assert torch.allclose(flat(got[0].avg), weighted([1, 1, 1]), atol=1e-7)


@pytest.mark.parametrize("claim", [float("nan"), float("inf"), -1000.0, 0.0])
def test_a_claim_that_is_not_a_finite_positive_number_drops_the_site(claim):
    got = merge([1000.0, 1000.0, claim])
    assert got[0].k_active == 2
    assert [s for s, _ in got[0].rejected] == ["site2"] and "must be a finite number > 0" in got[0].rejected[0][1]
    assert torch.allclose(flat(got[0].avg), weighted([1, 1, 0]), atol=1e-7)


def test_a_huge_claim_counts_as_the_cap_not_as_claimed():
    got = merge([1000.0, 1000.0, 1e12])  # cap: guard_norm_ratio (3) x the other sites' median
    assert torch.allclose(flat(got[0].avg), weighted([1000, 1000, 3000]), atol=1e-7)
    assert got[0].rejected[0][0] == "site2" and "counted as 3000" in got[0].rejected[0][1]


def test_token_weights_with_two_sites_bound_each_by_the_other():
    ranks, w, notes = token_weights([100.0, 1e9], [0, 1], 3.0)
    assert ranks == [0, 1] and w.tolist() == [100.0, 300.0] and notes[0][0] == 1


def test_weighted_rules_on_known_values():
    xs = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 6.0]])
    w = torch.tensor([1.0, 1.0, 2.0], dtype=torch.float64)
    assert aggregate(xs, "mean", weights=w).avg.tolist() == [1.0, 3.0]
    # top-k columns: each coordinate averaged over the sites that sent it, by their weights
    sparse = aggregate(xs, "mean", weights=w, sparse=[slice(0, 2)]).avg.tolist()
    assert sparse == [2.0, 6.0]
    assert aggregate(xs, "median", weights=w).avg.tolist() == aggregate(xs, "median").avg.tolist()


def test_the_window_is_h_times_the_median_step_time():
    assert agreed_window([(1.0, 0.1), (2.0, 0.2), (1.0, 0.1)], 20) == pytest.approx(2.0)
    assert agreed_window([(0.0, 0.0)], 20) == 0.0  # nobody measured yet: H steps
    liar = [(1.0, 0.1), (1.0, 0.1), (1.0, float("inf")), (1.0, float("nan")), (1.0, -5.0)]
    assert agreed_window(liar, 10) == pytest.approx(1.0)
    assert math.isfinite(agreed_window([(1.0, 1e300), (1.0, 0.1), (1.0, 0.1)], 10))


@pytest.mark.parametrize("diloco,train,msg", [
    ({"h_policy": "time", "mode": "async"}, {}, "async sites already run at their own pace"),
    ({"h_policy": "time", "algorithm": "ddp"}, {}, "ddp has no rounds"),
    ({"h_policy": "time"}, {"steps": 100}, "size the run with diloco.rounds"),
    ({"h_policy": "time", "h": "auto"}, {}, "size the run with diloco.rounds"),
    ({"h_policy": "minutes"}, {}, "diloco.h_policy"),
    ({"merge_weighting": "votes"}, {}, "diloco.merge_weighting"),
    ({"late_merge": True, "mode": "overlap"}, {}, "diloco.late_merge"),
    ({"late_merge": True, "algorithm": "ddp"}, {}, "diloco.late_merge"),
])
def test_bad_policies_are_refused_in_one_line(diloco, train, msg):
    with pytest.raises(ConfigError, match=msg) as e:
        from_dict({"diloco": diloco, "train": train})
    assert "\n" not in str(e.value)
