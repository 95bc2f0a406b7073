"""launch: the Lighthouse's join window from the predicted exchange (`diloco.grace`).

A round's quorum forms as soon as every live site has asked for it; while a live site is missing, the
Lighthouse waits its join window (run.join_timeout_ms) for it, then the round commits with the sites
that came (`late_merge` folds the late site's work into its next round). A fixed window is wrong at
both ends: 5 s is several exchanges on a fast link, and every straggler round idles the punctual sites
that long; on a slow link it is a fraction of one exchange, and a site a moment late is dropped. With
`diloco.grace = g` a fresh launch sets the window to g x the exchange tune-h predicted for the spec and
its H (the tune's sync_s), within [MIN_MS, MAX_WAIT_S]. The window is written into the run's recorded
spec, so a Lighthouse that supervision restarts or moves keeps it, and told as a `grace` event.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from dilococtl.spec_types import RunSpec
from dilococtl.tune.history import newest_tune
from trainer.rules.tables import MAX_WAIT_S

MIN_MS = 250  # a shorter window drops a site that is only a scheduler tick behind the others
EVENT = "grace"


def window(spec: RunSpec, store) -> dict[str, Any] | None:
    """{"join_timeout_ms", "grace", "predicted_sync_s", "tune_id"} for a spec with diloco.grace > 0 and a
    tune of its file at its H; None otherwise."""
    g = spec.diloco.grace
    if not g:
        return None
    t = newest_tune(store, spec.path, spec.diloco.h)
    sync_s = t.prediction.get("sync_s") if t is not None else None
    if not (isinstance(sync_s, int | float) and not isinstance(sync_s, bool) and math.isfinite(sync_s) and sync_s > 0):
        return None  # no tune, or a record that is not a duration
    ms = round(min(max(g * sync_s * 1000, MIN_MS), MAX_WAIT_S * 1000))
    return {"join_timeout_ms": int(ms), "grace": g, "predicted_sync_s": float(sync_s), "tune_id": t.id}


def describe(got: dict[str, Any]) -> str:
    """One line for launch's progress and the event."""
    return (f"grace {got['grace']:g} x the {got['predicted_sync_s']:.2f} s exchange tune {got['tune_id']} predicted: "
            f"a round's quorum waits {got['join_timeout_ms'] / 1000:.2f} s for a late site")


def apply(spec: RunSpec, store, progress=lambda m: None) -> tuple[RunSpec, dict[str, Any] | None]:
    """`spec` with run.join_timeout_ms from diloco.grace, and what was chosen (None: nothing to apply; a
    spec that asks for grace without a tune keeps its join_timeout_ms, with a note)."""
    got = window(spec, store)
    if got is None:
        if spec.diloco.grace:
            progress(f"note: diloco.grace: no tune-h prediction for this spec at H {spec.diloco.h}; a round's quorum "
                     f"waits run.join_timeout_ms ({spec.run.join_timeout_ms} ms) for a late site "
                     f"(`dilococtl tune-h SPEC` predicts the exchange)")
        return spec, None
    progress(describe(got))
    return dataclasses.replace(spec, run=dataclasses.replace(spec.run, join_timeout_ms=got["join_timeout_ms"])), got
