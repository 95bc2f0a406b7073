"""A site of two processes stops as one: SIGTERM that reaches one process first (Slurm signals the
nodes of a job moments apart) still ends both after the same inner step with a checkpoint saved.

Before, the signalled rank left for its checkpoint's collectives while the other went on into its next
step's gradient all-reduce; both waited in different collectives until torchrun killed them, nothing
saved, and a 2-node Slurm site at its time limit failed instead of requeueing (CI, test_slurm_lab)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.dist_helpers import start_site, tiny_config
from tests.integration.test_trainer_dist import lighthouse, records  # noqa: F401 (a fixture)
from trainer.checkpoints.checkpoint_trust import verify

pytestmark = pytest.mark.slow


def _worker(torchrun_pid: int, rank: int) -> int:
    """The pid of torchrun's worker of global rank `rank`."""
    kids = subprocess.run(["pgrep", "-P", str(torchrun_pid)], capture_output=True, text=True).stdout.split()
    for pid in map(int, kids):
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in env:
            return pid
    raise AssertionError(f"no worker of rank {rank} under torchrun {torchrun_pid}: {kids}")


def test_sigterm_to_one_rank_stops_the_whole_site_after_one_step(tmp_path, lighthouse):  # noqa: F811
    cfg = tiny_config(tmp_path, 0, sites=1, **{"diloco.rounds": 400})
    proc = start_site(cfg, lighthouse, tmp_path / "site0.log", nproc=2)
    try:
        deadline = time.monotonic() + 180
        while not records(tmp_path, "site0", "round"):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "site0.log").read_text()[-3000:]
            time.sleep(0.5)
        os.kill(_worker(proc.pid, 1), signal.SIGTERM)  # rank 1 only: rank 0 hears of it from rank 1
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = (tmp_path / "site0.log").read_text()[-3000:]
    events = [e for e in records(tmp_path, "site0", "event") if e.event == "preempted"]
    assert len(events) == 1, log  # rank 0 writes the site's records: it stopped on its peer's signal
    assert (tmp_path / "site0" / "node0.preempted").exists(), log
    rounds = records(tmp_path, "site0", "round")
    assert 0 < rounds[-1].round < 400
    newest = max((tmp_path / "site0" / "checkpoints").glob("round-*"))
    assert verify(newest) == "", newest  # both ranks' shards and the manifest that vouches for them
    assert sorted(p.name for p in newest.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"], list(newest.iterdir())
