"""Streaming DiLoCo's fragments (arXiv 2501.18512): the split of the parameters and the schedule.

With `diloco.fragments = F` the parameter tensors are dealt into F fragments of about equal size
(`split`), and fragment f is exchanged after inner step `offsets(h, F)[f]` of each round (the last at
the round's end), each with its own guarded exchange and outer step, so the largest exchange of a round
carries about 1/F of the bytes. F = 1 is one exchange of everything at the round's end.

No torch at import: tune-h (dilococtl.tune.transfer) splits a model's sizes with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from trainer.rules.diloco_config import DilocoConfig

if TYPE_CHECKING:
    from trainer.codecs.compression import Compressor


def split(numels: Sequence[int], f: int) -> list[list[int]]:
    """F non-empty sets of parameter indices (each ascending) covering them all, ordered by their first index.

    Balanced by size, not cut in model order: a contiguous cut of a small model peaks well above 1/F (the
    tiny preset's largest of 4 was 27.8%, its embedding and head being an eighth each), and a fragment's
    coordinates need not be neighbours (each has its own outer step). Largest first, each into the lightest
    fragment, then moves and swaps out of the heaviest while they lower it. Deterministic: the same sizes
    give every site the same split.
    """
    n = len(numels)
    if not 1 <= f <= n:
        raise ValueError(f"{f} fragments of {n} parameter tensors: need 1 <= fragments <= {n}")
    if any(x < 0 for x in numels):
        raise ValueError("parameter sizes must be >= 0")
    parts: list[list[int]] = [[] for _ in range(f)]
    load = [0] * f
    for i in sorted(range(n), key=lambda i: (-numels[i], i)):  # an empty fragment takes the next, even of size 0
        b = min(range(f), key=lambda b: (load[b], len(parts[b]), b))
        parts[b].append(i)
        load[b] += numels[i]
    for _ in range(4 * n):  # each pass lowers the heaviest load or ends: bounded, and quick
        hi = max(range(f), key=lambda b: (load[b], -b))
        best = None  # (new peak of the pair, item out of hi, item back or None, other fragment)
        for b in range(f):
            if b == hi:
                continue
            for i in parts[hi]:
                if len(parts[hi]) > 1:
                    cand = (max(load[hi] - numels[i], load[b] + numels[i]), i, None, b)
                    best = cand if best is None or cand[0] < best[0] else best
                for j in parts[b]:
                    d = numels[i] - numels[j]
                    if d > 0:
                        cand = (max(load[hi] - d, load[b] + d), i, j, b)
                        best = cand if best is None or cand[0] < best[0] else best
        if best is None or best[0] >= load[hi]:
            break
        _, i, j, b = best
        parts[hi].remove(i)
        parts[b].append(i)
        load[hi], load[b] = load[hi] - numels[i], load[b] + numels[i]
        if j is not None:
            parts[b].remove(j)
            parts[hi].append(j)
            load[hi], load[b] = load[hi] + numels[j], load[b] - numels[j]
    return sorted((sorted(p) for p in parts), key=lambda p: p[0])


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
    from trainer.codecs.compression import Compressor  # torch: only where a codec is made

    return Compressor(spec=d.compression, error_feedback=d.error_feedback, decay=d.error_feedback_decay,
                      seed=seed + 7919 * fragment, site=site, options=d.codec_options())
