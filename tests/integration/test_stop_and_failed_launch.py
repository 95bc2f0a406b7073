"""Processes and records: stop signals only the run's own processes, a launch that fails for any reason
ends failed with its reason, and stop --force always ends a record."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from dilococtl import coordinators, runs
from dilococtl.cli import app
from dilococtl.errors import DilocoError
from dilococtl.nodes import LocalNode
from dilococtl.spec import spec_from_dict
from dilococtl.states import RunState
from dilococtl.store import Store
from tests.ports import free_port


def _spec(tmp_path, name: str = "ident"):
    # ports of its own: launch checks them free first (dilococtl.ports), and the defaults may be in use here
    return spec_from_dict({"run": {"name": name, "lighthouse_port": free_port(), "base_port": free_port()},
                           "diloco": {"h": 2, "rounds": 1},
                           "sites": [{"name": "a", "hosts": ["local"], "work_dir": str(tmp_path / "w")},
                                     {"name": "b", "hosts": ["local"], "work_dir": str(tmp_path / "w")}]},
                          str(tmp_path / "spec.toml"))


@pytest.fixture
def stranger():
    """An unrelated process leading its own process group: what the OS may give a dead run's pid to."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    yield p
    p.kill()
    p.wait()


def test_stop_of_a_finished_run_leaves_a_reused_lighthouse_pid_alone(tmp_path, stranger):
    with Store.open() as store:
        run = store.create_run(_spec(tmp_path))
        store.set_lighthouse(run.id, {"host": "local", "pid": stranger.pid, "url": "http://127.0.0.1:1",
                                      "log_path": str(tmp_path / "lh.log")})
        store.set_run_state(run.id, RunState.RUNNING)
        store.set_run_state(run.id, RunState.FINISHED)
    r = CliRunner().invoke(app, ["stop", run.id, "--grace", "1"])
    assert r.exit_code == 0, r.output
    time.sleep(0.3)
    assert stranger.poll() is None  # before: SIGTERM to its process group
    # issue 42: a finished run has nothing to stop, and says so (before: the status table, silently)
    assert r.stdout.strip() == f"nothing to stop: run {run.id} finished"
    with Store.open() as store:
        assert store.get_run(run.id).state == RunState.FINISHED
        assert not [e for e in store.events(run.id) if e.event == "stopped"]
    r = CliRunner().invoke(app, ["stop", run.id, "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["stopped"] is False


def test_refresh_of_an_ended_run_leaves_a_reused_lighthouse_pid_alone(tmp_path, stranger):
    with Store.open() as store:
        run = store.create_run(_spec(tmp_path))
        store.set_lighthouse(run.id, {"host": "local", "pid": stranger.pid})
        from dilococtl.nodes import NodePool

        with NodePool(run.spec().ssh) as pool:
            coordinators.stop_lighthouse(store.get_run(run.id), pool)
    time.sleep(0.3)
    assert stranger.poll() is None


@pytest.mark.parametrize("where", ["plan", "start"])
def test_a_launch_that_fails_unexpectedly_ends_failed_with_its_reason(tmp_path, monkeypatch, where):
    # before: an OSError (a 300-character site name gave ENAMETOOLONG) left the run `launching` for
    # good, and status/stop exited 1 on it
    def boom(*a, **k):
        raise OSError(36, "File name too long")

    with monkeypatch.context() as m, Store.open() as store:
        if where == "plan":
            m.setattr(runs.plan_mod, "build", boom)
        else:
            m.setattr(LocalNode, "start_detached", boom)
        with pytest.raises(DilocoError, match=r"launch of run \S+ failed: OSError: \[Errno 36\] File name too long"):
            runs.launch(_spec(tmp_path), store=store)
        (run,) = store.list_runs()
        assert run.state == RunState.FAILED
        assert run.exit_reason == "launch failed: OSError: [Errno 36] File name too long"
    for args in (["status", run.id], ["stop", run.id, "--grace", "1"], ["stop", run.id, "--force", "--grace", "1"]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0, (args, r.output)


def test_stop_force_ends_a_record_whose_stored_spec_is_damaged(tmp_path):
    with Store.open() as store:
        run = store.create_run(_spec(tmp_path))
        store.db.conn.execute("UPDATE runs SET spec_json = ? WHERE id = ?", ("{not json", run.id))
        store.db.conn.commit()
    r = CliRunner().invoke(app, ["stop", run.id, "--grace", "1"])
    assert r.exit_code == 2, r.output
    assert r.stderr.strip().splitlines()[-1].startswith("error: <stored spec>: not valid JSON")
    r = CliRunner().invoke(app, ["stop", run.id, "--force", "--grace", "1"])
    assert r.exit_code == 0, r.output
    with Store.open() as store:
        got = store.get_run(run.id)
        assert got.state == RunState.STOPPED and "forced" in got.exit_reason


def test_a_record_that_breaks_a_newer_rule_stays_readable_and_stoppable(tmp_path):
    # recorded before names were limited to 64 characters
    with Store.open() as store:
        run = store.create_run(_spec(tmp_path))
        doc = run.spec_json.replace('"name": "a"', '"name": "' + "a" * 300 + '"')
        store.db.conn.execute("UPDATE runs SET spec_json = ? WHERE id = ?", (doc, run.id))
        store.db.conn.commit()
    for args in (["status", run.id], ["stop", run.id, "--grace", "1"]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0, (args, r.output)


@pytest.mark.parametrize("grace", ["inf", "nan", "-1", "1e12"])
def test_stop_grace_must_be_a_finite_bound(tmp_path, grace):
    with Store.open() as store:
        run = store.create_run(_spec(tmp_path))
    r = CliRunner().invoke(app, ["stop", run.id, "--grace", grace])
    assert r.exit_code == 2, r.output
    assert r.stderr.strip().splitlines()[-1].startswith("error: --grace: must be in [0, 86400] seconds")
    with Store.open() as store:
        assert store.get_run(run.id).state == RunState.LAUNCHING  # nothing changed


def test_refresh_does_not_take_a_reused_node_pid_for_the_run(tmp_path, stranger):
    # the node's process ended without an exit file and its pid went to another process: before, the
    # run stayed `running` for as long as that stranger lived
    from dilococtl.nodes import NodePool
    from dilococtl.states import SiteState

    with Store.open() as store:
        run = store.create_run(_spec(tmp_path))
        for site in ("a", "b"):
            store.set_node(run.id, site, "local", pid=stranger.pid, state=SiteState.RUNNING)
        store.set_run_state(run.id, RunState.RUNNING)
        with NodePool(run.spec().ssh) as pool:
            run = runs.refresh(store.get_run(run.id), store=store, pool=pool)
        assert [n.state for n in store.nodes(run.id)] == [SiteState.FAILED, SiteState.FAILED]
        assert run.state == RunState.FAILED
    assert stranger.poll() is None


def test_resume_leaves_a_reused_leftover_pid_alone(tmp_path, stranger):
    # resume stops what is left of a dead site's job before relaunching it: only the run's own processes
    from dilococtl import resume
    from dilococtl.nodes import NodePool

    with NodePool(_spec(tmp_path).ssh) as pool:
        t0 = time.monotonic()
        resume._wait_gone(pool, "RUN-X", [("local", stranger.pid)], 5.0)
        assert time.monotonic() - t0 < 2  # not the run's: gone at once, no grace waited out
        for sig in ("TERM", "KILL"):
            resume._signal(pool, "RUN-X", "local", stranger.pid, sig)
    time.sleep(0.3)
    assert stranger.poll() is None
