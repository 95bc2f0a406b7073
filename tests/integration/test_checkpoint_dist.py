"""Checkpointer with 2 processes on gloo: per-rank tensors and DTensor shards, async save, prune,
a corrupt rank-1 file making both ranks fall back together.

The tests start this file as a script: once per rank (`python3 THIS RANK WORLD ROOT OUT`), or as
a lone saver to SIGKILL (`python3 THIS saver ROOT`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

WORLD = 2


def _worker(rank: int, world: int, root: Path, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from trainer.checkpoints.checkpoint import Checkpointer
    from trainer.checkpoints.manifest_sign import round_dir

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    events: list[list] = []
    ck = Checkpointer(root, keep=2, async_save=True, on_event=lambda k, m, d: events.append([k, m, d]))

    def state(r: int) -> dict:
        full = torch.arange(8 * world, dtype=torch.float32).reshape(2 * world, 4) * r
        return {
            f"rank{rank}": {"w": torch.full((50,), 100.0 * rank + r), "tag": f"r{rank}-round{r}"},
            "sharded": distribute_tensor(full, mesh, [Shard(0)]),  # each rank holds its rows only
            "round": r,
        }

    def blank() -> dict:
        zeros = torch.zeros(2 * world, 4)
        return {
            f"rank{rank}": {"w": torch.zeros(50), "tag": ""},
            "sharded": distribute_tensor(zeros, mesh, [Shard(0)]),
            "round": -1,
        }

    def summary(s: dict) -> dict:
        return {"w0": s[f"rank{rank}"]["w"][0].item(), "tag": s[f"rank{rank}"]["tag"],
                "local_rows": s["sharded"].to_local().tolist(), "round": s["round"]}

    allreduce_ok: list[bool] = []
    for r in (1, 2, 3):
        s = state(r)
        ck.save(r, s)
        s[f"rank{rank}"]["w"].add_(1000.0)  # training mutates tensors while the save runs
        for _ in range(5):  # and runs its own collectives on the default group meanwhile
            t = torch.full((16,), float(rank + 1))
            dist.all_reduce(t)
            allreduce_ok.append(bool(torch.equal(t, torch.full((16,), float(sum(range(1, world + 1)))))))
    ck.wait()
    rounds_after_save = ck.rounds()
    manifest = json.loads((round_dir(root, 3) / "manifest.json").read_text())

    first = blank()
    loaded_first = ck.load_latest(first)

    # The corruption lives in the test, not the library: rank 1 truncates its own data file.
    dist.barrier()
    if rank == 1:
        victim = sorted(round_dir(root, 3).glob("__1_*.distcp"))[0]
        victim.write_bytes(victim.read_bytes()[:10])
    dist.barrier()
    second = blank()
    loaded_second = ck.load_latest(second)
    ck.close()

    out.write_text(json.dumps({
        "rounds_after_save": rounds_after_save, "manifest_files": sorted(manifest["files"]),
        "manifest_round": manifest["round"], "loaded_first": loaded_first, "first": summary(first),
        "loaded_second": loaded_second, "second": summary(second), "events": events,
        "allreduce_ok": allreduce_ok,
    }))
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_save_prune_load_and_fall_back_together(tmp_path: Path):
    # imported here: this file is also the ranks' script, which cannot import tests/
    from tests.ports import free_port

    root = tmp_path / "site0" / "checkpoints"
    port = free_port(1)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
               OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(WORLD), str(root),
                               str(tmp_path / f"out{r}.json")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(WORLD)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=180)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{logs[r][-3000:]}"
    res = [json.loads((tmp_path / f"out{r}.json").read_text()) for r in range(WORLD)]

    # keep=2 pruned round 1; both ranks see the same complete checkpoints
    assert [x["rounds_after_save"] for x in res] == [[2, 3], [2, 3]]
    assert sorted(p.name for p in root.iterdir()) == ["round-000002", "round-000003"]
    # rank 0's manifest covers the files every rank wrote
    files = res[0]["manifest_files"]
    assert res[0]["manifest_round"] == 3
    assert ".metadata" in files
    assert any(f.startswith("__0_") for f in files) and any(f.startswith("__1_") for f in files)

    assert [x["allreduce_ok"] for x in res] == [[True] * 15] * WORLD

    rows_per_rank = 2  # 2*WORLD rows split over WORLD ranks
    for rank, x in enumerate(res):
        assert x["loaded_first"] == 3
        # each rank got back its own tensor (as it was at save time, not after the later mutation)
        assert x["first"] == {
            "w0": 100.0 * rank + 3, "tag": f"r{rank}-round3", "round": 3,
            "local_rows": [[float((rank * rows_per_rank + i) * 4 + j) * 3 for j in range(4)]
                           for i in range(rows_per_rank)],
        }
        # rank 1's file of round 3 was truncated: both ranks fell back to round 2
        assert x["loaded_second"] == 2
        assert x["second"]["w0"] == 100.0 * rank + 2
        assert x["second"]["tag"] == f"r{rank}-round2"
        assert x["second"]["local_rows"] == [[float((rank * rows_per_rank + i) * 4 + j) * 2 for j in range(4)]
                                             for i in range(rows_per_rank)]

    # events come from rank 0 only: three completed saves, one skipped checkpoint naming the file
    kinds = [e[0] for e in res[0]["events"]]
    assert kinds == ["checkpoint"] * 3 + ["checkpoint_skipped"]
    skipped = res[0]["events"][-1][2]
    assert skipped["path"] == str(root / "round-000003")
    assert "__1_" in skipped["why"] and "manifest says" in skipped["why"]
    assert res[1]["events"] == []


def _saver(root: Path) -> None:
    """Saves rounds of a 32 MB state forever, announcing each save as it starts."""
    import torch

    from trainer.checkpoints.checkpoint import Checkpointer

    torch.set_num_threads(1)
    ck = Checkpointer(root, keep=2, async_save=True)
    w = torch.zeros(8 << 20)
    r = 0
    while True:
        r += 1
        w.fill_(float(r))
        ck.save(r, {"w": w, "round": r})
        print(f"started {r}", flush=True)


@pytest.mark.slow
def test_sigkill_mid_save_never_leaves_a_checkpoint_taken_for_complete(tmp_path: Path):
    import torch

    from trainer.checkpoints.checkpoint import Checkpointer

    root = tmp_path / "checkpoints"
    p = subprocess.Popen([sys.executable, __file__, "saver", str(root)], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        for line in p.stdout:
            if line.strip() == "started 4":  # rounds 1-3 are complete, round 4 is being written
                break
        p.send_signal(signal.SIGKILL)
    finally:
        p.kill()
        p.wait(timeout=30)
    assert p.returncode == -signal.SIGKILL

    events: list[tuple] = []
    ck = Checkpointer(root, on_event=lambda k, m, d: events.append((k, d)))
    target = {"w": torch.empty(8 << 20), "round": 0}
    got = ck.load_latest(target)
    assert got in (3, 4)  # 4 only if its manifest made it before the kill
    assert target["round"] == got
    assert torch.equal(target["w"], torch.full((8 << 20,), float(got)))
    if got == 3:
        assert [(k, d["round"]) for k, d in events] == [("checkpoint_skipped", 4)]
    else:
        assert events == []


if __name__ == "__main__":
    if sys.argv[1] == "saver":
        _saver(Path(sys.argv[2]))
    else:
        _worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
