"""Checkpointer in one process (no process group): round-trip, prune, corruption, async."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from trainer.checkpoints.checkpoint import Checkpointer
from trainer.checkpoints.checkpoint_trust import CheckpointError, verify
from trainer.checkpoints.manifest_sign import MANIFEST, round_dir


class Events:
    def __init__(self):
        self.seen: list[tuple[str, str, dict]] = []

    def __call__(self, kind: str, message: str, detail: dict) -> None:
        self.seen.append((kind, message, detail))

    def kinds(self, kind: str) -> list[tuple[str, str, dict]]:
        return [e for e in self.seen if e[0] == kind]


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 6)).pow(2).sum().backward()
        opt.step()
    return model, opt


def _full_state(seed: int, round: int) -> dict:
    model, opt = _trained(seed)
    rng = np.random.default_rng(seed)
    rng.random(7)  # move it off its seed state
    np.random.seed(seed)
    torch.manual_seed(seed + 100)
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "round": round,
        "inner_lr": 0.0125 * (seed + 1),
        "sites": ["a", "b"],
        "np_rng": rng.bit_generator.state,
        "np_legacy": np.random.get_state(),
        "torch_rng": torch.get_rng_state(),
        "blob": bytes(range(seed, seed + 5)),
        "outer": {"momentum": torch.full((3,), float(seed)), "steps": seed * 10},
    }


def _blank_state() -> dict:
    """What a restarted trainer holds before loading: other weights, placeholder values."""
    model, opt = _trained(999)  # stepped, so the optimizer's state has tensors to load into
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "round": -1,
        "inner_lr": 0.0,
        "sites": [],
        "np_rng": None,
        "np_legacy": None,
        "torch_rng": torch.zeros_like(torch.get_rng_state()),
        "blob": b"",
        "outer": {"momentum": torch.zeros(3), "steps": 0},
    }


def _assert_same(loaded: dict, saved: dict) -> None:
    for k, t in saved["model"].items():
        assert torch.equal(loaded["model"][k], t), k
    for pid, s in saved["optim"]["state"].items():
        for name, t in s.items():
            assert torch.equal(loaded["optim"]["state"][pid][name], t), (pid, name)
    assert loaded["optim"]["param_groups"][0]["lr"] == saved["optim"]["param_groups"][0]["lr"]
    assert loaded["round"] == saved["round"]
    assert loaded["inner_lr"] == saved["inner_lr"]
    assert loaded["sites"] == saved["sites"]
    assert loaded["np_rng"] == saved["np_rng"]
    assert loaded["np_legacy"][0] == saved["np_legacy"][0]
    assert np.array_equal(loaded["np_legacy"][1], saved["np_legacy"][1])
    assert loaded["np_legacy"][2:] == saved["np_legacy"][2:]
    assert torch.equal(loaded["torch_rng"], saved["torch_rng"])
    assert loaded["blob"] == saved["blob"]
    assert torch.equal(loaded["outer"]["momentum"], saved["outer"]["momentum"])
    assert loaded["outer"]["steps"] == saved["outer"]["steps"]


@pytest.mark.parametrize("async_save", [False, True])
def test_round_trip_nested_state(tmp_path: Path, async_save: bool):
    events = Events()
    ck = Checkpointer(tmp_path / "ckpt", keep=3, async_save=async_save, on_event=events)
    saved = _full_state(seed=3, round=12)
    ck.save(12, saved)
    ck.wait()

    manifest = json.loads((round_dir(tmp_path / "ckpt", 12) / MANIFEST).read_text())
    assert manifest["round"] == 12
    assert ".metadata" in manifest["files"]
    for name, entry in manifest["files"].items():
        assert (round_dir(tmp_path / "ckpt", 12) / name).stat().st_size == entry["size"]
    assert [e[2]["round"] for e in events.kinds("checkpoint")] == [12]

    target = _blank_state()
    weight = target["model"]["0.weight"]
    exp_avg = target["optim"]["state"][0]["exp_avg"]
    assert not torch.equal(weight, saved["model"]["0.weight"])
    assert ck.load_latest(target) == 12
    _assert_same(target, saved)
    # tensors are filled in place: a model holding these tensors sees the loaded values
    assert target["model"]["0.weight"] is weight
    assert target["optim"]["state"][0]["exp_avg"] is exp_avg

    # the loaded RNG states reproduce the saved generators' next draws
    a = np.random.default_rng()
    a.bit_generator.state = target["np_rng"]
    b = np.random.default_rng()
    b.bit_generator.state = saved["np_rng"]
    assert np.array_equal(a.random(4), b.random(4))


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(42)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _step_both(pairs) -> None:
    x = torch.randn(3, 6)
    for m, o in pairs:
        o.zero_grad()
        m(x).pow(2).sum().backward()
        o.step()


@pytest.mark.parametrize("form", ["plain", "dcp_helpers"])
def test_fresh_optimizer_resumes_like_the_original(tmp_path: Path, form: str):
    model, opt = _trained(1)
    ck = Checkpointer(tmp_path, async_save=False)
    if form == "plain":
        ck.save(1, {"model": model.state_dict(), "optim": opt.state_dict()})
    else:
        ck.save(1, {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)})

    model2, opt2 = _fresh()  # a restarted process: the optimizer has no per-parameter state yet
    if form == "plain":
        target = {"model": model2.state_dict(), "optim": opt2.state_dict()}
        assert target["optim"]["state"] == {}
    else:
        target = {"model": model2.state_dict(), "optim": get_optimizer_state_dict(model2, opt2)}
    assert ck.load_latest(target) == 1
    if form == "plain":
        # the empty state was replaced by the saved one, int keys included
        assert sorted(target["optim"]["state"]) == [0, 1, 2, 3]
        assert torch.equal(target["optim"]["state"][2]["exp_avg"], opt.state_dict()["state"][2]["exp_avg"])
    opt2.load_state_dict(target["optim"])  # model2 already holds the loaded tensors in place

    _step_both([(model, opt), (model2, opt2)])  # same batch: identical updates iff the state matched
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)


def test_keep_prunes_to_newest(tmp_path: Path):
    events = Events()
    ck = Checkpointer(tmp_path, keep=2, async_save=True, on_event=events)
    for r in range(1, 6):
        ck.save(r, {"w": torch.full((4,), float(r)), "round": r})
    ck.wait()
    assert ck.rounds() == [4, 5]
    assert sorted(p.name for p in tmp_path.glob("round-*")) == ["round-000004", "round-000005"]
    assert ck.latest() == 5
    assert [e[2]["round"] for e in events.kinds("checkpoint")] == [1, 2, 3, 4, 5]


def test_prune_removes_dead_partial_saves(tmp_path: Path):
    ck = Checkpointer(tmp_path, keep=2, async_save=False)
    ck.save(1, {"w": torch.ones(2)})
    ck.save(2, {"w": torch.ones(2)})
    (round_dir(tmp_path, 2) / MANIFEST).unlink()  # a save killed before its manifest
    ck.save(3, {"w": torch.ones(2)})
    assert ck.rounds() == [1, 3]
    assert not round_dir(tmp_path, 2).exists()


def _corrupt_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _data_file(ckdir: Path) -> Path:
    return sorted(ckdir.glob("*.distcp"))[0]


CORRUPTIONS = {
    "no_manifest": (lambda d: (d / MANIFEST).unlink(), "no manifest"),
    "truncated": (lambda d: _truncate(_data_file(d)), "bytes, manifest says"),
    "flipped_byte": (lambda d: _corrupt_flip(_data_file(d)), "checksum mismatch"),
    "metadata_gone": (lambda d: (d / ".metadata").unlink(), "file .metadata is missing"),
    "manifest_garbage": (lambda d: (d / MANIFEST).write_text("{\"round\": 2, \"fil"), "manifest unreadable"),
}


@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
def test_corrupt_newest_falls_back_to_previous(tmp_path: Path, how: str):
    corrupt, why = CORRUPTIONS[how]
    events = Events()
    ck = Checkpointer(tmp_path, keep=3, async_save=False, on_event=events)
    ck.save(1, {"w": torch.full((1000,), 1.0), "round": 1})
    ck.save(2, {"w": torch.full((1000,), 2.0), "round": 2})
    corrupt(round_dir(tmp_path, 2))

    fresh = Checkpointer(tmp_path, on_event=events)  # a restarted trainer
    assert fresh.rounds() == [1]
    assert fresh.latest() == 1
    target = {"w": torch.zeros(1000), "round": 0}
    assert fresh.load_latest(target) == 1
    assert torch.equal(target["w"], torch.full((1000,), 1.0))
    assert target["round"] == 1
    skipped = events.kinds("checkpoint_skipped")
    assert len(skipped) == 1
    assert skipped[0][2]["path"] == str(round_dir(tmp_path, 2))
    assert skipped[0][2]["round"] == 2
    assert why in skipped[0][2]["why"]
    assert why in skipped[0][1]


def test_same_process_sees_in_place_corruption(tmp_path: Path):
    # latest()/load_latest() re-hash even when this process wrote (and cached) the checkpoint
    ck = Checkpointer(tmp_path, async_save=False)
    ck.save(1, {"w": torch.full((100,), 1.0)})
    ck.save(2, {"w": torch.full((100,), 2.0)})
    _corrupt_flip(_data_file(round_dir(tmp_path, 2)))
    assert ck.latest() == 1


def test_all_corrupt_or_empty_gives_none(tmp_path: Path):
    events = Events()
    ck = Checkpointer(tmp_path / "never", on_event=events)
    assert ck.load_latest({"w": torch.zeros(2)}) is None
    assert ck.latest() is None and ck.rounds() == []

    ck = Checkpointer(tmp_path / "c", async_save=False, on_event=events)
    ck.save(1, {"w": torch.ones(2)})
    _truncate(_data_file(round_dir(tmp_path / "c", 1)))
    target = {"w": torch.zeros(2)}
    assert ck.load_latest(target) is None
    assert torch.equal(target["w"], torch.zeros(2))
    assert len(events.kinds("checkpoint_skipped")) == 1


def test_resave_over_leftover_of_same_round(tmp_path: Path):
    ck = Checkpointer(tmp_path, async_save=False)
    ck.save(1, {"w": torch.full((3,), 1.0)})
    ck.save(2, {"w": torch.full((3,), 2.0)})
    _truncate(_data_file(round_dir(tmp_path, 2)))
    (round_dir(tmp_path, 2) / "junk.distcp").write_bytes(b"old")
    ck.save(2, {"w": torch.full((3,), 22.0)})  # resumed from 1, reached round 2 again
    assert not (round_dir(tmp_path, 2) / "junk.distcp").exists()
    target = {"w": torch.zeros(3)}
    assert ck.load_latest(target) == 2
    assert torch.equal(target["w"], torch.full((3,), 22.0))


def test_async_save_snapshots_state_and_wait_completes(tmp_path: Path):
    events = Events()
    ck = Checkpointer(tmp_path, async_save=True, on_event=events)
    w = torch.zeros(200_000)
    info = {"step": 5}
    ck.save(7, {"w": w, "info": info})
    w.add_(1.0)  # training goes on while the checkpoint is written
    info["step"] = 6
    ck.wait()
    assert verify(round_dir(tmp_path, 7)) == ""
    assert [e[2]["round"] for e in events.kinds("checkpoint")] == [7]
    assert events.kinds("checkpoint")[0][2]["seconds"] >= 0
    target = {"w": torch.ones(200_000), "info": {}}
    assert ck.load_latest(target) == 7
    assert torch.equal(target["w"], torch.zeros(200_000))
    assert target["info"] == {"step": 5}
    ck.close()


def test_async_save_failure_surfaces_at_wait(tmp_path: Path, monkeypatch):
    import trainer.checkpoints.checkpoint as mod

    events = Events()
    ck = Checkpointer(tmp_path, async_save=True, on_event=events)
    ck.save(1, {"w": torch.ones(2)})
    ck.wait()

    def disk_gone(path):
        raise OSError(5, "Input/output error", str(path))

    monkeypatch.setattr(mod, "_file_entry", disk_gone)
    ck.save(2, {"w": torch.ones(2)})  # returns: the failure happens in the checkpoint thread
    with pytest.raises(CheckpointError, match=r"round 2 .* failed: rank 0: OSError: .*Input/output error"):
        ck.wait()
    assert not (round_dir(tmp_path, 2) / MANIFEST).exists()
    assert ck.rounds() == [1]
    assert [e[2]["round"] for e in events.kinds("checkpoint")] == [1]
    monkeypatch.undo()
    ck.save(3, {"w": torch.ones(2)})  # the checkpointer stays usable
    ck.wait()
    assert ck.rounds() == [1, 3]


def test_state_that_does_not_fit_is_one_clear_error(tmp_path: Path):
    ck = Checkpointer(tmp_path, async_save=False)
    ck.save(1, {"w": torch.ones(2)})
    with pytest.raises(CheckpointError, match="Missing key in checkpoint state_dict: extra"):
        ck.load_latest({"w": torch.zeros(2), "extra": torch.zeros(1)})


def test_bad_arguments(tmp_path: Path):
    with pytest.raises(ValueError, match="keep"):
        Checkpointer(tmp_path, keep=0)
    ck = Checkpointer(tmp_path, async_save=False)
    with pytest.raises(ValueError, match="must be a dict"):
        ck.save(1, [torch.ones(1)])  # type: ignore[arg-type]


def test_copy_of_checkpoint_dir_verifies(tmp_path: Path):
    # a checkpoint copied elsewhere (e.g. to another node) still verifies: the manifest is relative
    ck = Checkpointer(tmp_path / "a", async_save=False)
    ck.save(4, {"w": torch.arange(10.0)})
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    other = Checkpointer(tmp_path / "b")
    target = {"w": torch.zeros(10)}
    assert other.load_latest(target) == 4
    assert torch.equal(target["w"], torch.arange(10.0))
