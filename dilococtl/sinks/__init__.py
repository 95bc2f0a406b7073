"""Metrics sinks: the run's round records written where teams already look (issue 39).

`[metrics] sinks = ["tensorboard", "wandb", "mlflow"]` in the run spec. The control plane's
collector (dilococtl.runs.collect) feeds every sink from the same rows of the store that status,
watch and report read (dilococtl.sinks.feed), so every view shows the same numbers. Each sink is one
class behind one interface (dilococtl.sinks.base.Sink) in its own module, and its package is an
optional extra; Prometheus is not a sink but an exporter (`dilococtl metrics serve`,
dilococtl.sinks.prometheus).
"""

from __future__ import annotations

import importlib.util

from dilococtl.errors import BadInput

# sink -> (the module it imports, the extra that installs it)
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow")}


def missing(sink: str) -> str | None:
    """The one-line error for a sink whose package is not installed; None when it is."""
    module, extra = PACKAGES[sink]
    if importlib.util.find_spec(module) is None:  # without importing it: spec check stays fast
        return f"metrics.sinks: {sink!r} needs the {module} package: pip install 'dilococtl[{extra}]'"
    return None


def check_installed(sinks: list[str]) -> None:
    """BadInput naming the extra to install for the first sink whose package is missing."""
    for sink in sinks:
        msg = missing(sink)
        if msg:
            raise BadInput(msg)
