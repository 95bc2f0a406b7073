"""The rule that turns a round's sync time and the inner step time into H (no torch import).

One home for it: `dilococtl tune-h` chooses H before a run with it, and the trainer re-chooses H
every round with it when `diloco.h_auto` is on.
"""

from __future__ import annotations

import math

GRID = 10  # H is chosen among multiples of this
HIDDEN = ("overlap", "async")  # modes whose exchange runs behind the next round's compute


def exposed_s(sync_s: float, compute_s: float, mode: str, land: float = 1.0) -> float:
    """Sync seconds the inner compute waits for: overlap and async hide the exchange behind the part of
    the next round before its update lands (`land`, diloco.overlap_land, of the round's compute)."""
    return max(0.0, sync_s - land * compute_s) if mode in HIDDEN else sync_s


def min_h(sync_s: float, step_s: float, budget: float, mode: str = "sync", grid: int = GRID,
          land: float = 1.0) -> int:
    """Smallest multiple of `grid` with exposed sync <= budget * H * step (no upper bound)."""
    if not 0 < budget < 1:
        raise ValueError(f"sync budget must be in (0, 1), got {budget:g}")
    if not step_s > 0 or not math.isfinite(step_s):
        raise ValueError(f"step time must be a finite number of seconds > 0, got {step_s:g}")
    if not sync_s >= 0 or not math.isfinite(sync_s):
        raise ValueError(f"sync time must be a finite number of seconds >= 0, got {sync_s:g}")
    # exposed(H) <= b*H*s  <=>  sync <= f*H*s with f = b (sync) or land + b (overlap, async)
    f = budget + (land if mode in HIDDEN else 0.0)
    h = max(1, math.ceil(sync_s / (f * step_s * grid) - 1e-9)) * grid
    while exposed_s(sync_s, h * step_s, mode, land) > budget * h * step_s * (1 + 1e-12):  # float edge
        h += grid
    return h


def efficiency(h: int, step_s: float, sync_s: float, mode: str = "sync", land: float = 1.0) -> float:
    """Predicted compute / (compute + exposed sync) at this H."""
    c = h * step_s
    return c / (c + exposed_s(sync_s, c, mode, land))


def clamped_h(sync_s: float, step_s: float, budget: float, h_min: int, h_max: int) -> int:
    """`min_h` for a sync time the trainer measured, within [h_min, h_max].

    The trainer measures the sync its compute waited for (in overlap mode only the wait shows), so
    the measured time is already the exposed one: the sync-mode rule applies in every mode.
    """
    return max(h_min, min(h_max, min_h(sync_s, step_s, budget, "sync")))
