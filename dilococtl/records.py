"""The recorded runs as one list (`dilococtl runs`), and removing old ones (`dilococtl runs rm`).

A row carries what an operator compares runs by: state, how long it ran, rounds done of planned,
the final validation perplexity and why it ended. Removing a run deletes its records in one
transaction and, when asked, its files: the run directory on every node (work_dir/runs/RUN_ID,
checkpoints and logs included) and the local report directory.
"""

from __future__ import annotations

import fnmatch
import math
import posixpath
import shlex
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from dilococtl.db import rows
from dilococtl.errors import BadInput, DilocoError
from dilococtl.states import ACTIVE_RUN_STATES, RunState


@dataclass(kw_only=True, slots=True)
class RunRow:
    id: str
    name: str
    state: str
    created: float  # unix seconds
    duration_s: float  # launch to end (or to now, while active)
    rounds: int  # the furthest round any site recorded
    rounds_planned: int
    final_val_ppl: float | None  # of the newest evaluated round (the lowest over sites)
    reason: str | None  # why it ended
    spec: str  # the file it was launched from

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _aggregates(store: Any) -> tuple[dict[str, int], dict[str, float]]:
    """Per run: the furthest round, and the validation perplexity of its newest evaluated round."""
    furthest = {r["run_id"]: r["n"] for r in rows(store.db, "SELECT run_id, MAX(round) AS n FROM rounds GROUP BY run_id")}
    ppl: dict[str, float] = {}
    for r in rows(store.db, """
            SELECT r.run_id, MIN(r.val_ppl) AS ppl FROM rounds r
            JOIN (SELECT run_id, MAX(round) AS last FROM rounds WHERE val_ppl IS NOT NULL GROUP BY run_id) m
              ON m.run_id = r.run_id AND r.round = m.last
            WHERE r.val_ppl IS NOT NULL GROUP BY r.run_id"""):
        if r["ppl"] is not None and math.isfinite(r["ppl"]):
            ppl[r["run_id"]] = r["ppl"]
    return furthest, ppl


def check_filters(*, state: str | None = None, limit: int | None = None) -> None:
    """A one-line BadInput for a state that does not exist or a limit below 1."""
    if state is not None and state not in {s.value for s in RunState}:
        raise BadInput(f"--state {state!r}: not a run state (one of {', '.join(s.value for s in RunState)})")
    if limit is not None and limit < 1:
        raise BadInput(f"--limit must be >= 1, got {limit}")


def list_runs(store: Any, *, state: str | None = None, name: str | None = None, since: float | None = None,
              limit: int | None = None, now: float | None = None) -> list[RunRow]:
    """Runs, newest first. `name` may be a glob (`lab-*`); `since`: created at or after (unix seconds)."""
    check_filters(state=state, limit=limit)
    now = time.time() if now is None else now
    furthest, ppl = _aggregates(store)
    out = []
    for r in store.list_runs(state=state):
        if name is not None and not fnmatch.fnmatchcase(r.name, name):
            continue
        if since is not None and r.created < since:
            continue
        end = now if r.state in ACTIVE_RUN_STATES else (r.finished or r.updated)
        out.append(RunRow(id=r.id, name=r.name, state=r.state, created=r.created,
                          duration_s=max(0.0, end - r.created), rounds=furthest.get(r.id, 0),
                          rounds_planned=r.spec().diloco.rounds, final_val_ppl=ppl.get(r.id),
                          reason=r.exit_reason, spec=r.spec_path))
        if limit is not None and len(out) >= limit:
            break
    return out


@dataclass(kw_only=True, slots=True)
class Removed:
    id: str
    name: str
    files: list[str] = field(default_factory=list)  # "host:path" of each directory removed
    errors: list[str] = field(default_factory=list)  # files that could not be removed (records are gone)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def run_dirs(store: Any, run: Any) -> list[tuple[str, str]]:
    """(host, RUN_DIR) of every node of the run, once each; only paths that end in the run id."""
    seen = []
    for n in store.nodes(run.id):
        d = (n.run_dir or "").rstrip("/")
        if d and posixpath.basename(d) == run.id and (n.host, d) not in seen:
            seen.append((n.host, d))
    return seen


def check_removable(runs: list[Any]) -> None:
    """Active runs are never removed: a one-line BadInput naming them."""
    active = [f"{r.id} ({r.state})" for r in runs if r.state in ACTIVE_RUN_STATES]
    if active:
        raise BadInput(f"not removing active run(s) {', '.join(active)}: stop them first (`dilococtl stop RUN`)")


def _remove_keys(run_id: str) -> list[str]:
    """The run's keys on this machine (CA, site and checkpoint keys; outer-service keys): all of them go
    with its files (issue 34)."""
    from dilococtl import paths, run_ca

    gone = []
    for d in (paths.run_ca_dir(run_id), paths.service_keys_dir(run_id)):
        if run_ca.remove(d):
            gone.append(f"local:{d}")
    return gone


def remove_runs(store: Any, runs: list[Any], *, files: bool = False,
                pool_factory: Callable[[Any], Any] | None = None, local_dir: Callable[[str], Any] | None = None,
                progress: Callable[[str], None] = lambda _m: None) -> list[Removed]:
    """Delete the records of `runs` (never an active one: all or nothing) and, with `files`, their files.

    pool_factory(run) gives a NodePool for the run's nodes; local_dir(run_id) the local directory of
    the run (reports), removed too.
    """
    check_removable(runs)
    out = []
    for r in runs:
        res = Removed(id=r.id, name=r.name)
        if files:
            dirs = run_dirs(store, r)
            if dirs and pool_factory is not None:
                with pool_factory(r) as pool:
                    for host, d in dirs:
                        progress(f"removing {host}:{d}")
                        try:
                            got = pool.get(host).run(f"rm -rf -- {shlex.quote(d)}", timeout=120)
                            if got.ok:
                                res.files.append(f"{host}:{d}")
                            else:
                                res.errors.append(f"{host}:{d}: {got.stderr.strip() or f'rm exited {got.rc}'}")
                        except DilocoError as e:
                            res.errors.append(f"{host}:{d}: {e}")
            if local_dir is not None:
                p = local_dir(r.id)
                if p.is_dir():
                    shutil.rmtree(p)
                    res.files.append(f"local:{p}")
            res.files += _remove_keys(r.id)
        store.delete_run(r.id)
        out.append(res)
    return out
