"""Watching the validation perplexity for a run that has started to diverge."""

from __future__ import annotations

import math
from dataclasses import dataclass


class Diverged(RuntimeError):
    """The run diverged and train.stop_on_divergence is on: stop instead of burning compute."""


@dataclass(kw_only=True, slots=True)
class Divergence:
    message: str  # one line: what rose, from what, since when
    best_round: int  # the round of the best evaluation so far (0: none finite yet)
    best_ppl: float


class DivergenceWatch:
    """Feed it every evaluation; it answers once per streak of `evals` rises in a row, or at once for a
    non-finite perplexity. `evals` 0 watches nothing."""

    def __init__(self, evals: int):
        self.evals = evals
        self.best_ppl = math.inf
        self.best_round = 0
        self.last = math.inf
        self.rising = 0

    def observe(self, rnd: int, ppl: float) -> Divergence | None:
        if self.evals <= 0:
            return None
        if not math.isfinite(ppl):
            return Divergence(message=f"validation perplexity is {ppl} at round {rnd}", best_round=self.best_round,
                              best_ppl=self.best_ppl)
        self.rising = self.rising + 1 if ppl > self.last else 0
        self.last = ppl
        if ppl < self.best_ppl:
            self.best_ppl, self.best_round = ppl, rnd
        if self.rising != self.evals:
            return None
        return Divergence(message=f"validation perplexity rose {self.evals} evaluations in a row, to {ppl:.4g} at "
                                  f"round {rnd} (best {self.best_ppl:.4g} at round {self.best_round})",
                          best_round=self.best_round, best_ppl=self.best_ppl)


def safe_exp(x: float) -> float:
    """exp that answers inf instead of raising OverflowError (a diverged loss can pass 709)."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf
