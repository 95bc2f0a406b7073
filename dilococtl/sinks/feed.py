"""The collector's side of the sinks: after each collection, write what is new to every sink, once.

Each sink keeps a small state file in its directory (HOME/runs/RUN_ID/metrics/SINK/state.json): the
newest round and event id it holds. Only rows past them are written, and the state moves on only
after the sink has taken them, so refreshing again (status, watch, launch --wait, stop) writes
nothing twice. A sink stays open for the life of the process (one W&B run per process, not one per
refresh) and is closed at exit. Several processes may collect one run (launch --wait, watch,
metrics serve): a lock file in the sink's directory lets one write at a time.

The collector only hands the run to a worker thread (`schedule`) and goes on: a sink's first open
(W&B starts a service process, MLflow its store) takes seconds, and collection must not wait for it.
At exit the worker finishes what was handed to it (at most DRAIN_S) and the sinks are closed.

A sink that fails (its package broke, an unwritable directory, a tracking server down) is turned
off for the rest of the process and records ONE event for the run (kind "error", detail.sink); the
collection, the other sinks and the training are not touched. Sinks run on the operator's machine,
never on the nodes, so training never waits on them.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import threading
from pathlib import Path

from dilococtl import paths
from dilococtl.sinks.base import EventLine, RunInfo, Sink
from dilococtl.sinks.points import new_points
from dilococtl.store import Run, Store

STATE_FILE = "state.json"
DRAIN_S = 120.0  # at exit: how long the worker may take to write what it was handed
LOCK_FILE = ".lock"  # flock'ed while a process writes the sink
_lock = threading.Lock()  # watch collects in a worker thread
_open: dict[tuple[str, str], Sink] = {}  # (sink, run id) -> the open sink of this process
_failed: set[tuple[str, str]] = set()  # (sink, run id) that failed in this process: off until it ends


def sink_dir(run_id: str, sink: str) -> Path:
    """Where a sink writes a run's files: under the run's local directory."""
    return paths.runs_dir() / run_id / "metrics" / sink


def make_sink(name: str, run: Run) -> Sink:
    spec = run.spec().metrics
    if name == "tensorboard":
        from dilococtl.sinks.tensorboard_sink import TensorBoardSink

        return TensorBoardSink()
    if name == "wandb":
        from dilococtl.sinks.wandb_sink import WandbSink

        return WandbSink(project=spec.wandb_project, mode=spec.wandb_mode)
    if name == "mlflow":
        from dilococtl.sinks.mlflow_sink import MlflowSink

        return MlflowSink(tracking_uri=spec.mlflow_tracking_uri, experiment=spec.mlflow_experiment)
    raise ValueError(f"unknown sink {name!r}")


def _read_state(d: Path) -> dict:
    try:
        return json.loads((d / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _write_state(d: Path, state: dict) -> None:
    tmp = d / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, d / STATE_FILE)


def export(run: Run, store: Store, sinks: list[str] | None = None) -> dict[str, int]:
    """Write the run's new rounds and events to its sinks (default: the spec's [metrics] sinks).

    Returns {sink: points written}. Never raises for a sink's failure (see the module docstring).
    """
    if sinks is None:
        try:
            sinks = run.spec().metrics.sinks
        except Exception:  # a damaged stored spec is status's business, not the sinks'
            return {}
    out = {}
    with _lock:
        for name in sinks:
            key = (name, run.id)
            if key in _failed:
                continue
            try:
                try:
                    out[name] = _export_one(name, run, store)
                except Exception:  # once more on a fresh session: W&B's service lost its connection once
                    _close(key)   # under load ("Connection lost"); the points are resent from the saved state
                    out[name] = _export_one(name, run, store)
            except Exception as e:  # a sink failing twice: one event, the sink off, collection goes on
                _failed.add(key)
                _close(key)
                _record_failure(store, run, name, e)
    return out


def _close(key: tuple[str, str]) -> None:
    sink = _open.pop(key, None)
    if sink is not None:
        try:
            sink.close()
        except Exception:
            pass


def _export_one(name: str, run: Run, store: Store) -> int:
    d = sink_dir(run.id, name)
    if not d.is_dir():
        paths.private_dir(d)
    # several processes collect the same run (launch --wait, watch, metrics serve): one writes at a
    # time; the others skip this turn rather than wait (the next refresh catches up)
    with open(d / LOCK_FILE, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0
        return _export_locked(name, run, store, d)


def _export_locked(name: str, run: Run, store: Store, d: Path) -> int:
    key = (name, run.id)
    state = _read_state(d)
    after, after_event = int(state.get("round", 0)), int(state.get("event_id", 0))
    points = new_points(store, run, after)
    found = store.events(run.id, after_id=after_event)
    if not points and not found:
        return 0
    sink = _open.get(key)
    if sink is None:
        sink = make_sink(name, run)
        sink.open(RunInfo(id=run.id, name=run.name, dir=d, state=state))
        _open[key] = sink
        _exit_first()
    x = points[-1].tokens if points else int(state.get("tokens", 0))
    events = [EventLine(id=e.id, t=e.t, tokens=x, site=e.site, event=e.event, message=e.message, round=e.round)
              for e in sorted(found, key=lambda e: e.id)]
    if points or events:
        sink.write(points, events)
        if points:
            state["round"], state["tokens"] = points[-1].round, points[-1].tokens
        if events:
            state["event_id"] = events[-1].id
        _write_state(d, state)
    return len(points)


def _record_failure(store: Store, run: Run, name: str, e: Exception) -> None:
    why = " ".join(str(e).split())[:300] or type(e).__name__
    try:
        for ev in store.events(run.id, kinds=["error"]):
            if ev.detail.get("sink") == name:
                return  # one event per sink and run, however many processes see it fail
        store.add_event(run.id, "error", f"metrics sink {name} failed, it is off: {why}", detail={"sink": name})
    except Exception:
        pass  # the store itself failing is the collector's to report, not the sink's


_cv = threading.Condition()
_pending: dict[str, Path] = {}  # run id -> the store it was collected into, waiting for the worker
_worker: threading.Thread | None = None
_stopping = False


def schedule(run: Run, store: Store) -> None:
    """The collector's call: export `run` in the background (nothing to do when it has no sinks)."""
    global _worker
    try:
        if not run.spec().metrics.sinks:
            return
    except Exception:  # a damaged stored spec is status's business, not the sinks'
        return
    with _cv:
        _pending[run.id] = Path(store.path)
        if _worker is None or not _worker.is_alive():
            _worker = threading.Thread(target=_work, name="dilococtl-sinks", daemon=True)
            _worker.start()
        _cv.notify()


def _work() -> None:
    from dilococtl.store import Store as _Store

    while True:
        with _cv:
            while not _pending and not _stopping:
                _cv.wait()
            if not _pending:
                return
            run_id, path = _pending.popitem()
        try:
            with _Store.open(path) as store:  # its own connection: the collector's stays its own
                export(store.get_run(run_id), store)
        except Exception:
            pass  # the store itself failing is the collector's to report


def drain(timeout_s: float = DRAIN_S) -> None:
    """Let the worker write what it was handed, then stop it."""
    global _stopping
    with _cv:
        _stopping = True
        _cv.notify()
    if _worker is not None:
        _worker.join(timeout_s)


def close_all() -> None:
    with _lock:
        for key, sink in list(_open.items()):
            try:
                sink.close()
            except Exception:
                pass
            _open.pop(key, None)


def _at_exit() -> None:
    drain()
    close_all()


def _exit_first() -> None:
    # atexit runs the newest registration first: a sink's package registers its own teardown when it
    # opens (W&B stops its service process), so the sinks' drain is registered again after it
    atexit.unregister(_at_exit)
    atexit.register(_at_exit)


atexit.register(_at_exit)
