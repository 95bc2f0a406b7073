"""The store and a run in it, as a command names them: for the CLI and for library code alike
(export reads a run's site directories the way `status RUN` finds the run)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

NO_RUNS = "no runs recorded yet (start one with `dilococtl launch SPEC`)"


@contextmanager
def read_store() -> Iterator[Any]:
    """The store, for a command that only reads it: None when nothing was ever recorded.

    Nothing is created: looking at an empty home leaves it empty.
    """
    from dilococtl.paths import db_path

    path = db_path(create=False)
    if not path.exists():
        yield None
        return
    from dilococtl.store import Store

    with Store.open(path) as store:
        yield store


def pick_run(store: Any, run: str | None) -> Any:
    """RUN as the user named it (id, id prefix or name), else the newest run; BadInput when none
    (watch follows the newest active run instead: dilococtl.queries.watched_run)."""
    from dilococtl.errors import BadInput

    if store is None:
        raise BadInput((f"no run {run!r}: " if run else "") + NO_RUNS)
    if run:
        return store.get_run(run)
    latest = store.latest_run()
    if latest is None:
        raise BadInput(NO_RUNS)
    return latest
