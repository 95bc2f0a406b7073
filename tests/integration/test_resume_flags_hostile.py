"""resume --auto's waits are finite: --poll and --backoff nan/inf/negative are one line, exit 2, and
nothing is relaunched (before: nan relaunched a site, then crashed; inf waited for ever)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from dilococtl.cli import app
from dilococtl.spec import spec_from_dict
from dilococtl.states import RunState
from dilococtl.store import Store


@pytest.mark.parametrize(("flag", "value", "expected"), [
    ("--poll", "nan", "--poll: must be in (0, 3600] seconds, got nan"),
    ("--poll", "inf", "--poll: must be in (0, 3600] seconds, got inf"),
    ("--poll", "0", "--poll: must be in (0, 3600] seconds, got 0"),
    ("--backoff", "inf", "--backoff: must be in [0, 3600] seconds, got inf"),
    ("--backoff", "nan", "--backoff: must be in [0, 3600] seconds, got nan"),
    ("--backoff", "-1", "--backoff: must be in [0, 3600] seconds, got -1"),
])
def test_resume_auto_waits_are_bounded(tmp_path, flag, value, expected):
    spec = spec_from_dict({"run": {"name": "r"}, "sites": [{"name": "a", "hosts": ["local"],
                                                            "work_dir": str(tmp_path / "w")}]}, "spec.toml")
    with Store.open() as store:
        run = store.create_run(spec)
        store.set_run_state(run.id, RunState.FAILED, reason="a site failed")
        launches = len(store.launches(run.id))
    r = CliRunner().invoke(app, ["resume", run.id, "--auto", flag, value])
    assert r.exit_code == 2, r.output
    assert r.stderr.strip().splitlines()[-1] == f"error: {expected}"
    with Store.open() as store:
        assert store.get_run(run.id).state == RunState.FAILED  # nothing relaunched
        assert len(store.launches(run.id)) == launches
