"""Inner learning-rate schedules: linear warmup, then cosine, WSD (warmup-stable-decay) or constant.

A run is sized in inner steps per site (`TrainerConfig.total_steps`); the schedule spans exactly
those steps, and `round_h` / `run_over` end the run on them whatever H does (h = "auto").
"""

from __future__ import annotations

import math

from trainer.rules.config import TrainConfig, TrainerConfig

MAX_TIME_STEPS = 4  # h_policy "time": a round takes at most this many times H inner steps


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Learning rate for inner step `step` (0-based) of a run of `total` inner steps.

    The decay ends on the last step: step `total - 1` runs at the floor (peak * min_lr_ratio).
    """
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return peak
    span = max(1, total - 1 - cfg.warmup_steps)
    done = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.schedule == "cosine":
        return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * done))
    # wsd: flat at the peak, then a linear decay over the last decay_fraction of the steps
    decay_start = 1.0 - cfg.decay_fraction
    if done <= decay_start:
        return peak
    return peak - (peak - floor) * (done - decay_start) / cfg.decay_fraction


def sized_in_steps(cfg: TrainerConfig) -> bool:
    """True when the run ends on its step count rather than its round count (train.steps or h = "auto")."""
    return bool(cfg.train.steps) or cfg.diloco.h_auto


def planned_rounds(cfg: TrainerConfig) -> int:
    """Outer rounds the run is planned to take: its inner steps over the starting H, rounded up
    (h = "auto" starts at h_min and only grows, so it takes at most this many)."""
    return -(-cfg.total_steps // cfg.diloco.h)


def round_h(h: int, steps_done: int, cfg: TrainerConfig) -> int:
    """Inner steps of the next round: H, cut so the run ends on exactly `total_steps` (0: none left)."""
    if not sized_in_steps(cfg):
        return h
    return max(0, min(h, cfg.total_steps - steps_done))


def run_over(rounds_done: int, steps_done: int, cfg: TrainerConfig) -> bool:
    """Whether the run is over: all its inner steps done (sized in steps), else all its rounds."""
    if sized_in_steps(cfg):
        return steps_done >= cfg.total_steps
    return rounds_done >= cfg.diloco.rounds


def is_last_round(rounds_done: int, steps_done: int, h: int, cfg: TrainerConfig) -> bool:
    """Whether the round about to run `h` steps (from `steps_done`) is the run's last."""
    return run_over(rounds_done + 1, steps_done + h, cfg)
