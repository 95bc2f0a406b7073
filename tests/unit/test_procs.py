"""Process identity (dilococtl.procs): a recorded pid is signalled only while it is the run's process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from dilococtl import procs
from dilococtl.nodes import LocalNode


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _gone_within(pid: int, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def node(tmp_path):
    return LocalNode("local")


@pytest.fixture
def reaped():
    """Popen'ed processes: killed and reaped after the test."""
    ps: list[subprocess.Popen] = []
    yield ps
    for p in ps:
        p.kill()
        p.wait()


def test_a_process_launch_started_is_ours_and_is_signalled(node, tmp_path):
    pid = node.start_detached("sleep 60", str(tmp_path / "a.log"), env=procs.marker_env("RUN-1"))
    try:
        assert procs.identify(node, pid, "RUN-1") == "ours"
        assert procs.identify(node, pid, "RUN-2") == "foreign"  # another run's id
        assert procs.signal_if_ours(node, pid, "RUN-2", "TERM") == "foreign"
        assert _alive(pid)
        assert procs.signal_if_ours(node, pid, "RUN-1", "TERM") == "ours"
        assert _gone_within(pid)
    finally:
        node.signal(pid, "KILL")


def test_a_reused_pid_in_its_own_group_is_left_alone(node, reaped):
    # what the OS may hand out after the run's process ended: an unrelated process group leader
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    reaped.append(other)
    assert procs.signal_if_ours(node, other.pid, "RUN-1", "KILL") == "foreign"
    time.sleep(0.2)
    assert other.poll() is None


def test_a_child_carrying_the_marker_but_not_leading_a_group_is_left_alone(node, reaped):
    # the marker is inherited by everything a run's process starts; only the group leader is a target
    child = subprocess.Popen(["sleep", "60"], env={**os.environ, **procs.marker_env("RUN-1")})
    reaped.append(child)
    assert procs.identify(node, child.pid, "RUN-1") == "foreign"


def test_an_older_runs_process_is_known_by_its_run_dir(node, tmp_path, reaped):
    # started before the marker existed: the wrapper shell's command line names .../runs/RUN_ID
    run_dir = tmp_path / "runs" / "RUN-9"
    run_dir.mkdir(parents=True)
    p = subprocess.Popen(["/bin/sh", "-c", f"cd {run_dir} && sleep 60"], start_new_session=True)
    reaped.append(p)
    assert procs.identify(node, p.pid, "RUN-9") == "ours"
    assert procs.identify(node, p.pid, "RUN-1") == "foreign"


def test_an_ended_process_is_gone(node, reaped):
    p = subprocess.Popen(["true"], start_new_session=True)
    p.wait()
    assert procs.identify(node, p.pid, "RUN-1") == "gone"
    zombie = subprocess.Popen(["true"], start_new_session=True, env={**os.environ, **procs.marker_env("RUN-1")})
    reaped.append(zombie)
    time.sleep(0.3)  # exited, not yet reaped: a zombie
    assert procs.identify(node, zombie.pid, "RUN-1") == "gone"


def test_signal_names_are_checked(node):
    with pytest.raises(ValueError):
        procs.signal_if_ours(node, 1, "RUN-1", "TERM; reboot")
