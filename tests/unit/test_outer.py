"""Outer-step math against values computed by hand."""

import pytest
import torch

from trainer.outer.optimizer import OuterState, effective_lr
from trainer.rules.diloco_config import DilocoConfig


def test_nesterov_outer_steps_match_hand_computation():
    cfg = DilocoConfig(sites=2, outer_lr=0.7, outer_momentum=0.9)
    outer = OuterState([torch.tensor([1.0, 2.0])], cfg)
    site1 = [torch.tensor([0.9, 1.8])]  # Δ1 = θ - θ1 = [0.1, 0.2]
    site2 = [torch.tensor([0.7, 2.2])]  # Δ2 = [0.3, -0.2]
    d1, d2 = outer.deltas(site1), outer.deltas(site2)
    avg = [(d1[0] + d2[0]) / 2]
    assert torch.allclose(avg[0], torch.tensor([0.2, 0.0]))
    # buf = 0.2; update = g + 0.9 buf = 0.38; θ = 1 - 0.7 * 0.38
    assert outer.step(avg, k_active=2) == pytest.approx(0.7)
    assert torch.allclose(outer.params[0].detach(), torch.tensor([0.734, 2.0]), atol=1e-6)
    # one of two sites active: lr 0.35; buf = 0.9*[0.2,0] + [0.1,0.1] = [0.28,0.1];
    # update = [0.1,0.1] + 0.9*buf = [0.352, 0.19]
    assert outer.step([torch.tensor([0.1, 0.1])], k_active=1) == pytest.approx(0.35)
    assert torch.allclose(outer.params[0].detach(), torch.tensor([0.734 - 0.35 * 0.352, 2.0 - 0.35 * 0.19]),
                          atol=1e-6)


def test_elastic_scaling_can_be_turned_off():
    assert effective_lr(DilocoConfig(sites=4, outer_lr=0.8, elastic_lr=False), 1) == pytest.approx(0.8)
    assert effective_lr(DilocoConfig(sites=4, outer_lr=0.8), 3) == pytest.approx(0.6)


def test_local_sgd_is_parameter_averaging():
    cfg = DilocoConfig(sites=2, algorithm="localsgd", outer_lr=0.7, outer_momentum=0.9)
    outer = OuterState([torch.tensor([1.0, 2.0])], cfg)
    sites = [[torch.tensor([0.5, 3.0])], [torch.tensor([1.5, 1.0])]]
    deltas = [outer.deltas(s)[0] for s in sites]
    outer.step([(deltas[0] + deltas[1]) / 2], k_active=1)  # no elastic scaling for plain averaging
    assert torch.allclose(outer.params[0].detach(), torch.tensor([1.0, 2.0]))
    outer.copy_to(sites[0])
    assert torch.equal(sites[0][0], outer.params[0].detach())


def test_state_dict_round_trip_keeps_momentum():
    cfg = DilocoConfig(sites=2)
    a = OuterState([torch.zeros(3)], cfg)
    a.step([torch.ones(3)], 2)
    b = OuterState([torch.zeros(3)], cfg)
    b.load_state_dict(a.state_dict())
    a.step([torch.ones(3)], 2)
    b.step([torch.ones(3)], 2)
    assert torch.equal(a.params[0], b.params[0])


def test_h_auto_grid_math():
    from trainer.modes.ft_exchange import agreed_h
    from trainer.rules.config import from_dict
    from trainer.rules.sync_rule import clamped_h

    d = from_dict({"diloco": {"h": "auto", "h_min": 20, "h_max": 500, "sync_budget": 0.1}}).diloco

    def needed_h(sync_s, step_s, d):
        return clamped_h(sync_s, step_s, d.sync_budget, d.h_min, d.h_max)

    assert d.h_auto and d.h == 20
    # sync 0.5 s, step 0.02 s: H >= 0.5 / (0.1 * 0.02) = 250
    assert needed_h(0.5, 0.02, d) == 250
    assert needed_h(0.501, 0.02, d) == 260  # up to the next multiple of 10
    assert needed_h(0.001, 0.02, d) == 20 and needed_h(50.0, 0.02, d) == 500  # bounds
    # the exchange costs the fastest arrival's sync (0.5 s); the slowest site's step (0.02 s) counts
    assert agreed_h([(0.5, 0.01), (2.0, 0.02)], 40, d) == 250
    assert agreed_h([(0.0, 0.0), (0.0, 0.0)], 40, d) == 40  # nothing measured yet: keep H
