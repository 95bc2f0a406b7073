"""Weights & Biases: offline by default, files under the run's directory, no network and no login.

One W&B run per dilococtl run, its id the run id (resumed by later processes), x axis "tokens"
(define_metric), events as text rows under "event". Offline runs land in
HOME/runs/RUN_ID/metrics/wandb/wandb/offline-run-*; upload them later with
`wandb sync HOME/runs/RUN_ID/metrics/wandb/wandb/offline-run-*`. `wandb_mode = "online"` logs live
(it needs `wandb login` or WANDB_API_KEY).
"""

from __future__ import annotations

import re

from dilococtl.sinks.base import EventLine, Point, RunInfo, Sink

X = "tokens"  # the x axis every series is plotted against
EVENTS = "event"  # the key of the events' text rows


def wandb_id(run_id: str) -> str:
    """A W&B run id from a dilococtl run id (W&B allows letters, digits, '-' and '_')."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", run_id)


class WandbSink(Sink):
    name = "wandb"

    def __init__(self, *, project: str = "dilococtl", mode: str = "offline") -> None:
        self.project = project
        self.mode = mode
        self._run = None

    def open(self, run: RunInfo) -> None:
        import wandb

        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, x_disable_meta=True,
                                  x_disable_machine_info=True)
        self._run = wandb.init(project=self.project, name=run.name, id=wandb_id(run.id), resume="allow",
                               mode=self.mode, dir=str(run.dir), settings=settings, reinit="create_new",
                               config={"dilococtl_run_id": run.id})
        self._run.define_metric(X)
        self._run.define_metric("*", step_metric=X)

    def write(self, points: list[Point], events: list[EventLine]) -> None:
        for p in points:
            self._run.log({X: p.tokens, "round": p.round, **p.values})
        for e in events:  # text rows, not a wandb.Table: a table is a media file W&B moves asynchronously
            self._run.log({X: e.tokens, EVENTS: e.text})

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
