"""The outer optimizer's default lr and momentum as a function of H and the sync mode (no torch).

One rule, written once, used wherever the spec leaves `diloco.outer_lr` / `diloco.outer_momentum`
unset: by the trainer (trainer.outer), the simulator, the outer service and the CLI's spec notes.
An explicit value in the spec always wins. The figures behind it: BENCHMARKS.md, "Quality of every
sync mode".
"""

from __future__ import annotations

from trainer.config import DilocoConfig


def default_outer_hparams(h: int, mode: str) -> tuple[float, float]:
    """(lr, momentum) of the outer Nesterov SGD for H inner steps per round in `mode`.

    RULE_PLACEHOLDER
    """
    return 0.7, 0.9


def outer_hparams(cfg: DilocoConfig) -> tuple[float, float]:
    """(lr, momentum) of the outer SGD: localsgd's fixed pair, the spec's values, else the rule."""
    if cfg.algorithm == "localsgd":
        return 1.0, 0.0
    lr, momentum = default_outer_hparams(cfg.h, cfg.mode)
    return (lr if cfg.outer_lr is None else cfg.outer_lr,
            momentum if cfg.outer_momentum is None else cfg.outer_momentum)
