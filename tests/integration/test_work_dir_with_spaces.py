"""A work_dir with a space is a valid spec; every remote command that uses it quotes it."""

from __future__ import annotations

import subprocess
from pathlib import Path

from dilococtl import runs
from dilococtl.nodes import NodePool
from dilococtl.spec import spec_from_dict
from dilococtl.states import RunState, SiteState
from dilococtl.store import Store


def test_refresh_reads_the_exit_code_under_a_work_dir_with_spaces(tmp_path):
    work = tmp_path / "my runs; rm -rf x"
    spec = spec_from_dict({"run": {"name": "sp"}, "diloco": {"h": 2, "rounds": 1},
                           "sites": [{"name": "a", "hosts": ["local"], "work_dir": str(work)}]}, "spec.toml")
    done = subprocess.Popen(["true"])
    done.wait()  # a finished process: refresh then reads its exit file
    with Store.open() as store:
        run = store.create_run(spec)
        (node,) = store.nodes(run.id)
        store.set_node(run.id, "a", "local", pid=done.pid, state=SiteState.RUNNING)
        store.set_run_state(run.id, RunState.RUNNING)
        exit_file = f"{node.run_dir}/a/node0.exit"
        Path(exit_file).parent.mkdir(parents=True, exist_ok=True)
        with open(exit_file, "w") as f:
            f.write("0\n")
        with NodePool(spec.ssh) as pool:
            run = runs.refresh(store.get_run(run.id), store=store, pool=pool)
        # before: `cat` got the path in pieces, read nothing, and the node was recorded as failed
        assert [n.state for n in store.nodes(run.id)] == [SiteState.FINISHED]
        assert run.state == RunState.FINISHED
