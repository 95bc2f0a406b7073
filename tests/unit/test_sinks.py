"""[metrics] sinks: the spec table, the missing-package error, and each sink read back with its own library."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from dilococtl.sinks import feed
from dilococtl.spec import spec_from_dict
from dilococtl.spec_types import SpecError
from dilococtl.store import Store
from tests import sink_readers
from tests.tui.fixtures import SPEC_TOML, add_rounds, make_run

ROOT = Path(__file__).resolve().parents[2]
SINKS = ["tensorboard", "wandb", "mlflow"]


@pytest.fixture(autouse=True)
def _fresh_sinks():
    yield
    feed.close_all()
    feed._failed.clear()


def _spec(metrics: str):
    return spec_from_dict(tomllib.loads(SPEC_TOML + "\n[metrics]\n" + metrics), "s.toml")


def test_metrics_table_parses_and_refuses_unknown_sinks():
    assert _spec('sinks = ["tensorboard", "mlflow"]').metrics.sinks == ["tensorboard", "mlflow"]
    assert spec_from_dict(tomllib.loads(SPEC_TOML), "s.toml").metrics.sinks == []
    for bad, msg in (('sinks = ["tensorbord"]', "metrics.sinks[0]: unknown sink 'tensorbord'"),
                     ('sinks = ["wandb", "wandb"]', "metrics.sinks[1]: 'wandb' is listed twice"),
                     ('wandb_mode = "cloud"', "metrics.wandb_mode: must be one of offline, online"),
                     ('sink = ["wandb"]', "metrics.sink: unknown key 'sink' (did you mean 'sinks'?)")):
        with pytest.raises(SpecError, match=msg.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                           .replace(")", r"\)").replace("?", r"\?")):
            _spec(bad)


def test_spec_check_names_the_extra_of_a_missing_sink_package(tmp_path):
    spec = tmp_path / "s.toml"
    spec.write_text(SPEC_TOML + '\n[metrics]\nsinks = ["tensorboard", "wandb"]\n')
    # sys.modules[name] = None is Python's own way to make a package absent (importlib finds nothing)
    code = ("import sys; sys.modules['wandb'] = None; from dilococtl.cli import main; "
            f"sys.argv = ['dilococtl', 'spec', 'check', {str(spec)!r}]; main()")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].endswith(
        "metrics.sinks: 'wandb' needs the wandb package: pip install 'dilococtl[wandb]'")


def _expected(store: Store, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """val ppl per site from the store's rows, x = tokens of all sites at that round."""
    out: dict[str, list[tuple[int, float]]] = {}
    rows = store.rounds(run_id)
    for r in sorted({x.round for x in rows}):
        x = sum(max((y.tokens for y in rows if y.site == s and y.round <= r), default=0) for s in ("site-a", "site-b"))
        for rec in rows:
            if rec.round == r:
                out.setdefault(f"val_ppl/{rec.site}", []).append((x, rec.val_ppl))
    return out


@pytest.mark.slow  # ~4 s: W&B starts its service process, MLflow its store
def test_every_sink_holds_the_stores_rounds_once_read_back_by_its_own_library():
    with Store.open() as store:
        run = make_run(store, state="finished", rounds=6)
        assert feed.export(run, store, SINKS) == dict.fromkeys(SINKS, 6)
        assert feed.export(run, store, SINKS) == dict.fromkeys(SINKS, 0)  # a refresh writes nothing again
        feed.close_all()  # a new process (status after launch --wait): the state files keep the place
        assert feed.export(run, store, SINKS) == dict.fromkeys(SINKS, 0)
        want = _expected(store, run.id)
        n_events = len(store.events(run.id))
    assert [len(v) for v in want.values()] == [6, 6]
    tb, texts = sink_readers.tensorboard_series(run.id)
    wb, wb_texts = sink_readers.wandb_series(run.id)
    ml = sink_readers.mlflow_series(run.id, list(want))
    for got in (tb, wb, ml):
        for key, pts in want.items():
            assert [x for x, _ in got[key]] == [x for x, _ in pts]
            assert max(abs(a[1] - b[1]) for a, b in zip(got[key], pts, strict=True)) <= 1e-6
    assert tb["global/val_ppl"] == wb["global/val_ppl"] and len(tb["global/val_ppl"]) == 6
    assert texts == wb_texts and len(texts) == n_events
    assert "site-a round 2: checkpoint: checkpoint round 2 complete (0.10 s)" in texts


def test_a_round_waits_for_every_running_site_then_is_written_once():
    with Store.open() as store:
        run = make_run(store, state="running", rounds=3)
        add_rounds(store, run.id, "site-a", 4, 5)  # site-b is still at round 3
        assert feed.export(run, store, ["tensorboard"]) == {"tensorboard": 3}
        add_rounds(store, run.id, "site-b", 4, 5)
        assert feed.export(run, store, ["tensorboard"]) == {"tensorboard": 2}
    feed.close_all()
    tb, _ = sink_readers.tensorboard_series(run.id)
    assert [x for x, _ in tb["val_ppl/site-b"]] == [2 * 20 * 1024 * r for r in range(1, 6)]


def test_a_failing_sink_records_one_event_and_the_others_go_on():
    with Store.open() as store:
        run = make_run(store, state="finished", rounds=4)
        blocked = feed.sink_dir(run.id, "tensorboard")
        blocked.parent.mkdir(parents=True)
        blocked.write_text("a file where the sink's directory should be")
        assert feed.export(run, store, ["tensorboard", "mlflow"]) == {"mlflow": 4}
        feed._failed.clear()  # another process fails again: still one event
        feed.export(run, store, ["tensorboard", "mlflow"])
        errors = [e for e in store.events(run.id, kinds=["error"]) if e.detail.get("sink")]
    assert len(errors) == 1 and errors[0].message.startswith("metrics sink tensorboard failed, it is off:")
    assert len(sink_readers.mlflow_series(run.id, ["val_ppl/site-a"])["val_ppl/site-a"]) == 4


def test_while_another_process_writes_a_sink_this_one_skips_its_turn():
    import fcntl

    with Store.open() as store:
        run = make_run(store, state="finished", rounds=3)
        d = feed.sink_dir(run.id, "tensorboard")
        d.mkdir(parents=True)
        with open(d / feed.LOCK_FILE, "a") as held:
            fcntl.flock(held, fcntl.LOCK_EX)  # flock locks are per open file: this one stands for another process
            assert feed.export(run, store, ["tensorboard"]) == {"tensorboard": 0}
        assert feed.export(run, store, ["tensorboard"]) == {"tensorboard": 3}


def test_the_collector_hands_the_run_to_the_worker_and_goes_on():
    with Store.open() as store:
        run = store.create_run(_spec('sinks = ["tensorboard"]'), run_id="20260101-000000-cafe", state="running")
        for site in ("site-a", "site-b"):
            add_rounds(store, run.id, site, 1, 3)
        feed.schedule(run, store)  # returns at once; the worker writes with its own connection
        feed.drain(30)
    tb, _ = sink_readers.tensorboard_series(run.id)
    assert [x for x, _ in tb["val_ppl/site-a"]] == [2 * 20 * 1024 * r for r in range(1, 4)]


_EXIT_SCRIPT = """
import sys
from dilococtl.sinks import feed
from dilococtl.store import Store
from tests.tui.fixtures import add_rounds
with Store.open() as store:
    run = store.get_run(sys.argv[1])
    feed.export(run, store)  # W&B opens here and registers its own teardown at exit
    for site in ("site-a", "site-b"):
        add_rounds(store, run.id, site, 4, 6)
    feed.schedule(run, store)  # handed to the worker; the process exits at once
"""


@pytest.mark.slow  # ~4 s: a process that starts W&B
def test_rounds_handed_over_just_before_exit_reach_wandb_before_it_shuts_down():
    with Store.open() as store:
        run = store.create_run(_spec('sinks = ["wandb"]'), run_id="20260101-000000-beef", state="running")
        for site in ("site-a", "site-b"):
            add_rounds(store, run.id, site, 1, 3)
    r = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, run.id], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    with Store.open() as store:
        assert [e.message for e in store.events(run.id, kinds=["error"])] == []
    wb, _ = sink_readers.wandb_series(run.id)
    assert [x for x, _ in wb["val_ppl/site-a"]] == [2 * 20 * 1024 * r for r in range(1, 7)]


def test_tensorboard_scalars_are_float64_and_the_readme_says_how_tensorboard_shows_them():
    """float64 keeps status's digits (a float32 ppl of 200 loses its 5th decimal); TensorBoard's default
    fast loader (its Rust data server) reads float32 scalars only and drew an empty board, so the
    README's command turns it off (seen on tensorboard 2.21 with the demo's event file)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.compat.proto import types_pb2

    with Store.open() as store:
        run = make_run(store, state="finished", rounds=2)
        assert feed.export(run, store, ["tensorboard"]) == {"tensorboard": 2}
    feed.close_all()
    (path,) = feed.sink_dir(run.id, "tensorboard").glob("events.out.tfevents.*")
    dtypes = {v.tensor.dtype for ev in EventFileLoader(str(path)).Load() for v in ev.summary.value
              if v.metadata.plugin_data.plugin_name == "scalars"}
    assert dtypes == {types_pb2.DT_DOUBLE}
    readme = (ROOT / "README.md").read_text()
    assert "`tensorboard --load_fast=false --logdir ~/.dilococtl/runs/RUN_ID/metrics/tensorboard`" in readme


def test_a_sink_that_fails_once_is_reopened_and_loses_nothing(monkeypatch):
    from dilococtl.sinks.tensorboard_sink import TensorBoardSink

    real, calls = TensorBoardSink.write, []

    def flaky(self, points, events):
        calls.append(len(points))
        if len(calls) == 1:
            raise RuntimeError("Connection lost")  # what W&B's service said once under load
        return real(self, points, events)

    monkeypatch.setattr(TensorBoardSink, "write", flaky)
    with Store.open() as store:
        run = make_run(store, state="finished", rounds=4)
        assert feed.export(run, store, ["tensorboard"]) == {"tensorboard": 4}
        assert not [e for e in store.events(run.id, kinds=["error"]) if e.detail.get("sink")]
    feed.close_all()
    assert calls == [4, 4]  # the same points again, on a fresh session
    tb, _ = sink_readers.tensorboard_series(run.id)
    assert len(tb["val_ppl/site-a"]) == 4
