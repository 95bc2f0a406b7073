"""Run length: the lr schedule spans the run's inner steps exactly, whatever H does."""

from __future__ import annotations

import pytest

from trainer.rules import config as C
from trainer.rules.schedule import is_last_round, lr_at, round_h, run_over
from trainer.rules.sync_rule import clamped_h
from trainer.rules.tables import ConfigError


def _cfg(**over) -> C.TrainerConfig:
    data = {"train": {"lr": 1e-3, "min_lr_ratio": 0.1, "warmup_steps": 5}, "diloco": {"h": 10, "rounds": 6}}
    for key, value in over.items():
        section, name = key.split(".")
        data.setdefault(section, {})[name] = value
    return C.from_dict(data)


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_lr_reaches_the_floor_on_the_last_step_not_before(schedule):
    cfg = _cfg(**{"train.schedule": schedule})
    total = cfg.total_steps
    assert total == 60
    lrs = [lr_at(s, total, cfg.train) for s in range(total)]
    assert lrs[0] == pytest.approx(1e-3 / 5) and lrs[4] == pytest.approx(1e-3)  # warmup
    assert lrs[-1] == pytest.approx(1e-4, rel=1e-12)
    assert min(lrs[:-1]) > 1e-4 * (1 + 1e-9)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:], strict=False))  # no rise after warmup


def test_train_steps_sizes_the_run_and_is_validated():
    assert _cfg(**{"train.steps": 137}).total_steps == 137
    assert _cfg().total_steps == 60  # h * rounds when unset
    with pytest.raises(ConfigError, match="train.steps: must be >= 0, got -1"):
        _cfg(**{"train.steps": -1})
    with pytest.raises(ConfigError, match="train.steps: async sites count pushes"):
        _cfg(**{"train.steps": 10, "diloco.mode": "async"})


def _drive(cfg: C.TrainerConfig, sync_s: float, step_s: float) -> tuple[list[int], list[float]]:
    """The loop's use of the helpers: rounds of round_h steps until run_over, H re-chosen after each."""
    d = cfg.diloco
    h, rounds, step, hs, lrs = d.h, 0, 0, [], []
    while not run_over(rounds, step, cfg):
        n = round_h(h, step, cfg)
        last = is_last_round(rounds, step, n, cfg)
        lrs += [lr_at(step + i, cfg.total_steps, cfg.train) for i in range(n)]
        step, rounds = step + n, rounds + 1
        hs.append(n)
        assert last == run_over(rounds, step, cfg)
        h = clamped_h(sync_s, step_s, d.sync_budget, d.h_min, d.h_max)  # what h_auto agrees on
    return hs, lrs


def test_auto_h_run_reaches_its_floor_on_its_last_step():
    # h = "auto" from 10; a sync of 2 s against 0.1 s steps at a 10% budget asks for H = 200
    cfg = _cfg(**{"diloco.h": "auto", "diloco.h_min": 10, "diloco.h_max": 500, "train.steps": 1000})
    hs, lrs = _drive(cfg, sync_s=2.0, step_s=0.1)
    assert hs == [10, 200, 200, 200, 200, 190]  # the last round is cut to end on the 1000th step
    assert len(lrs) == sum(hs) == 1000
    floor = cfg.train.lr * cfg.train.min_lr_ratio
    assert lrs[-1] == pytest.approx(floor, rel=1e-12)
    assert min(lrs[:-1]) > floor * (1 + 1e-9)


def test_auto_h_without_train_steps_ends_on_h_min_times_rounds():
    # sized as `rounds` rounds of the starting H; H grows, so the run takes fewer rounds
    cfg = _cfg(**{"diloco.h": "auto", "diloco.h_min": 10, "diloco.rounds": 6})
    hs, lrs = _drive(cfg, sync_s=0.5, step_s=0.1)
    assert hs == [10, 50] and len(lrs) == 60
    assert lrs[-1] == pytest.approx(cfg.train.lr * cfg.train.min_lr_ratio, rel=1e-12)


def test_fixed_h_keeps_its_rounds():
    cfg = _cfg()
    assert [round_h(10, s, cfg) for s in (0, 50, 60)] == [10, 10, 10]
    assert not run_over(5, 50, cfg) and run_over(6, 60, cfg)
    assert is_last_round(5, 50, 10, cfg) and not is_last_round(4, 40, 10, cfg)
