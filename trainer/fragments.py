"""Streaming DiLoCo's fragments (arXiv 2501.18512): the split of the parameters and the schedule.

With `diloco.fragments = F` the parameters, in model order, are cut into F contiguous blocks of about
equal size, and fragment f is exchanged after inner step `offsets(h, F)[f]` of each round (the last at
the round's end), each with its own guarded exchange and outer step, so the largest exchange of a round
carries about 1/F of the bytes. F = 1 is one exchange of everything at the round's end.

No torch at import: tune-h (dilococtl.sync_model) splits a model's sizes with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from trainer.config import DilocoConfig

if TYPE_CHECKING:
    from trainer.compression import Compressor


def _blocks(numels: Sequence[int], start: int, cap: int) -> int:
    """How many blocks of at most `cap` the greedy packing of numels[start:] takes."""
    n, used = 0, cap + 1
    for x in numels[start:]:
        if used + x > cap:
            n, used = n + 1, 0
        used += x
    return n


def split(numels: Sequence[int], f: int) -> list[range]:
    """F contiguous, non-empty ranges of parameter indices covering them all, in order.

    The largest fragment is as small as a contiguous cut allows (the peak of an exchange); among cuts
    that reach it, each boundary is the one nearest its share i/F of the total. Deterministic.
    """
    n = len(numels)
    if not 1 <= f <= n:
        raise ValueError(f"{f} fragments of {n} parameter tensors: need 1 <= fragments <= {n}")
    if any(x < 0 for x in numels):
        raise ValueError("parameter sizes must be >= 0")
    lo, hi = max(numels, default=0), sum(numels)
    while lo < hi:  # the smallest cap that f blocks can keep to
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _blocks(numels, 0, mid) <= f else (mid + 1, hi)
    cap, total = lo, sum(numels)
    cuts, start, acc = [], 0, 0  # acc: the sum of numels[:start]
    for i in range(1, f):
        best, run = None, 0
        for end in range(start + 1, n - (f - i) + 1):  # the block is numels[start:end]
            run += numels[end - 1]
            if run > cap:
                break
            if _blocks(numels, end, cap) > f - i:  # the rest would not fit the cap
                continue
            if best is None or abs(acc + run - total * i / f) < abs(best[1] - total * i / f):
                best = (end, acc + run)
        assert best is not None  # the greedy cut always fits
        cuts.append(best[0])
        start, acc = best
    bounds = [0, *cuts, n]
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def offsets(h: int, f: int) -> list[int]:
    """The inner step of a round of h after which fragment i is exchanged: floor((i+1)·h/F), at least
    step 1 (a round shorter than F steps, cut at the run's end, exchanges several after one step)."""
    if f < 1 or h < 1:
        raise ValueError(f"need h >= 1 and fragments >= 1, got h {h}, fragments {f}")
    return [max(1, (i + 1) * h // f) for i in range(f)]


def due(done: int, h: int, f: int) -> list[int]:
    """The fragments exchanged right after inner step `done` of a round of h, in fragment order."""
    return [i for i, o in enumerate(offsets(h, f)) if o == done]


def compressor(d: DilocoConfig, seed: int, site: int, fragment: int = 0) -> Compressor:
    """A site's codec for one fragment: its own residuals (error feedback) and PowerSGD state. Fragment 0
    is seeded as the unfragmented codec; the others apart from it, alike at every site."""
    from trainer.compression import Compressor  # torch: only where a codec is made

    return Compressor(spec=d.compression, error_feedback=d.error_feedback, decay=d.error_feedback_decay,
                      seed=seed + 7919 * fragment, site=site, options=d.codec_options())
