"""Inner learning-rate schedules: linear warmup, then cosine, WSD (warmup-stable-decay) or constant."""

from __future__ import annotations

import math

from trainer.config import TrainConfig


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Learning rate for inner step `step` (0-based) of a run of `total` inner steps."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return peak
    span = max(1, total - cfg.warmup_steps)
    done = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.schedule == "cosine":
        return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * done))
    # wsd: flat at the peak, then a linear decay over the last decay_fraction of the steps
    decay_start = 1.0 - cfg.decay_fraction
    if done <= decay_start:
        return peak
    return peak - (peak - floor) * (done - decay_start) / cfg.decay_fraction
