"""Issue 34, finding 4: a checkpoint is read only when the run's key signed it; nothing of ours is a pickle.

A crafted checkpoint whose DCP `.metadata` is a pickle that creates a file must be refused by the
trainer's load path and by `dilococtl export` before DCP reads it: the file is never created.
"""

from __future__ import annotations

import json
import os
import pickle
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer import jsonwire
from trainer.checkpoints.checkpoint import Checkpointer
from trainer.checkpoints.checkpoint_trust import (
    KEY_BYTES,
    KEY_ENV,
    KEY_FILE,
    CheckpointKeyError,
    default_key_path,
    load_key,
    make_key,
    verify,
)
from trainer.checkpoints.manifest_sign import MANIFEST, round_dir, sign
from trainer.rules import config as C
from trainer.rules.model_config import ModelConfig


class _Evil:
    """Unpickling this creates `marker` (what an attacker's .metadata would do, with a command instead)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _save(root: Path, key: bytes, rnd: int = 1) -> Path:
    Checkpointer(root, async_save=False, key=key).save(rnd, {"w": torch.arange(8.0), "meta": {"round": rnd}})
    return round_dir(root, rnd)


def _plant(ckdir: Path, marker: Path, how: str, attacker_key: bytes) -> None:
    """Replace .metadata with a pickle bomb and write a manifest that covers it, signed `how`."""
    (ckdir / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    manifest = json.loads((ckdir / MANIFEST).read_text())
    if how == "unsigned":  # exactly what the CRC-only manifest (format 1) accepted
        files = {n: {"size": (ckdir / n).stat().st_size, "crc32": f"{zlib.crc32((ckdir / n).read_bytes()):08x}"}
                 for n in manifest["files"]}
        manifest = {"format": 1, "round": manifest["round"], "world_size": 1, "files": files}
    else:  # a well-formed manifest, signed with a key that is not the run's
        import hashlib

        manifest["files"][".metadata"] = {"size": (ckdir / ".metadata").stat().st_size,
                                          "sha256": hashlib.sha256((ckdir / ".metadata").read_bytes()).hexdigest()}
        manifest = sign({k: v for k, v in manifest.items() if k != "signature"}, attacker_key)
    (ckdir / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("how,why", [("unsigned", "unsigned checkpoint (manifest format 1"),
                                     ("wrong_key", "signature does not verify")])
def test_trainer_load_refuses_a_crafted_checkpoint_and_never_unpickles_it(tmp_path: Path, how: str, why: str):
    run_key, attacker_key = os.urandom(KEY_BYTES), os.urandom(KEY_BYTES)
    marker = tmp_path / "pwned"
    ckdir = _save(tmp_path / "ck", run_key)
    _plant(ckdir, marker, how, attacker_key)
    events: list = []
    ck = Checkpointer(tmp_path / "ck", key=run_key, on_event=lambda k, m, d: events.append((k, m, d)))
    target = {"w": torch.zeros(8), "meta": {}}
    assert ck.load_latest(target) is None
    assert not marker.exists()
    assert torch.equal(target["w"], torch.zeros(8))
    [(kind, message, detail)] = events
    assert kind == "checkpoint_skipped" and why in detail["why"]
    assert message.startswith(f"checkpoint {ckdir} skipped: ") and "\n" not in message


def test_signed_checkpoint_verifies_and_any_tampering_is_refused(tmp_path: Path):
    key = os.urandom(KEY_BYTES)
    ckdir = _save(tmp_path / "ck", key)
    manifest = json.loads((ckdir / MANIFEST).read_text())
    assert manifest["format"] == 2 and len(manifest["signature"]) == 64
    assert set(manifest["files"][".metadata"]) == {"size", "sha256"}
    assert verify(ckdir, key) == ""
    assert verify(ckdir, os.urandom(KEY_BYTES)) == "signature does not verify under this run's checkpoint key: refused"

    data = sorted(ckdir.glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1  # one bit
    data.write_bytes(bytes(raw))
    assert verify(ckdir, key).startswith(f"file {data.name} checksum mismatch (sha256 ")

    raw[len(raw) // 2] ^= 1
    data.write_bytes(bytes(raw))
    assert verify(ckdir, key) == ""
    manifest["round"] = 1  # a field changed without the key: the signature no longer matches
    manifest["files"][data.name]["size"] += 0
    manifest["created"] += 1
    (ckdir / MANIFEST).write_text(json.dumps(manifest))
    assert verify(ckdir, key) == "signature does not verify under this run's checkpoint key: refused"


def test_manifest_names_outside_the_directory_are_refused(tmp_path: Path):
    key = os.urandom(KEY_BYTES)
    ckdir = _save(tmp_path / "ck", key)
    m = json.loads((ckdir / MANIFEST).read_text())
    m["files"]["../../etc/passwd"] = {"size": 1, "sha256": "0"}
    (ckdir / MANIFEST).write_text(json.dumps(sign({k: v for k, v in m.items() if k != "signature"}, key)))
    assert verify(ckdir, key) == "manifest entry '../../etc/passwd' is not a file of this directory"


def test_tensor_free_values_are_stored_as_json_not_pickle(tmp_path: Path, monkeypatch):
    key = os.urandom(KEY_BYTES)
    state = {"w": torch.ones(3), "opt": {"state": {0: {"step": torch.tensor(3.0)}},
                                         "param_groups": [{"betas": (0.9, 0.95), "params": [0], "foreach": None}]},
             "rng": np.random.get_state(), "blob": b"\x00\x01", "lr": float("nan")}
    Checkpointer(tmp_path, async_save=False, key=key).save(2, state)

    def no_pickle(*_a, **_k):
        raise AssertionError("our code unpickled")

    import trainer.checkpoints.checkpoint_pack as ck_mod

    assert not hasattr(ck_mod, "pickle")  # the module does not even import it
    monkeypatch.setattr(pickle, "loads", no_pickle)  # DCP's own reads use pickle.load / torch.load
    target = {"w": torch.zeros(3), "opt": {"state": {}, "param_groups": []}, "rng": None, "blob": b"", "lr": 0.0}
    assert Checkpointer(tmp_path, key=key).load_latest(target) == 2
    assert target["opt"]["state"][0]["step"].item() == 3.0  # int key and tensor rebuilt from the JSON skeleton
    assert target["opt"]["param_groups"] == [{"betas": (0.9, 0.95), "params": [0], "foreach": None}]
    assert target["rng"][0] == "MT19937" and np.array_equal(target["rng"][1], state["rng"][1])
    assert target["blob"] == b"\x00\x01" and np.isnan(target["lr"])


def test_values_json_cannot_hold_are_refused_at_save(tmp_path: Path):
    from trainer.checkpoints.checkpoint_trust import CheckpointError

    ck = Checkpointer(tmp_path, async_save=False, key=os.urandom(KEY_BYTES))
    with pytest.raises(CheckpointError, match="cannot checkpoint this value: cannot store a value of type .*Path"):
        ck.save(1, {"w": torch.ones(1), "where": Path("/x")})


def test_json_decoder_refuses_what_it_did_not_make():
    with pytest.raises(jsonwire.WireError, match="unknown tag 'os.system'"):
        jsonwire.loads(b'{"os.system": "touch /tmp/x"}')
    with pytest.raises(jsonwire.WireError, match="not stored by this codec"):
        jsonwire.loads(b'{"ndarray": {"dtype": "|O", "shape": [1], "data": ""}}')


def test_key_files_are_private_and_checked(tmp_path: Path):
    path = tmp_path / "keys" / KEY_FILE
    key = make_key(path)
    assert len(key) == KEY_BYTES and make_key(path) == key  # made once, then reused
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(path.parent).st_mode & 0o777 == 0o700
    os.chmod(path, 0o644)
    with pytest.raises(CheckpointKeyError, match=r"mode 644 lets others read it \(must be 0600\)"):
        load_key(path)
    with pytest.raises(CheckpointKeyError, match="cannot read it"):
        load_key(tmp_path / "missing.key")


def test_default_key_is_the_named_file_or_the_users_own(tmp_path: Path, monkeypatch):
    assert default_key_path() == Path(os.environ["DILOCOCTL_HOME"]) / KEY_FILE
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "run.key"))
    with pytest.raises(CheckpointKeyError, match="run.key: cannot read it"):
        Checkpointer(tmp_path / "ck")  # a key launch names must exist: never a new one in its place
    make_key(tmp_path / "run.key")
    assert Checkpointer(tmp_path / "ck").key == load_key(tmp_path / "run.key")


# --- export --------------------------------------------------------------------------------------


def _site(tmp_path: Path, run_id: str) -> Path:
    site = tmp_path / "run" / "site0"
    site.mkdir(parents=True)
    tcfg = C.TrainerConfig(model=ModelConfig(preset="tiny"), run=C.RunConfig(run_id=run_id, site="site0",
                                                                                run_dir=str(tmp_path / "run")))
    (site / "config.toml").write_text(C.dump_toml(tcfg))
    return site


@pytest.mark.parametrize("how,why", [("unsigned", "unsigned checkpoint"), ("wrong_key", "signature does not verify")])
def test_export_refuses_a_crafted_checkpoint_and_never_unpickles_it(tmp_path: Path, how: str, why: str):
    from dilococtl.errors import BadInput
    from dilococtl.export import export
    from dilococtl.plan import run_ca_dir

    run_key = make_key(run_ca_dir("r1") / KEY_FILE)  # what launch made for run r1
    site = _site(tmp_path, "r1")
    marker = tmp_path / "pwned"
    ckdir = _save(site / "checkpoints", run_key)
    _plant(ckdir, marker, how, os.urandom(KEY_BYTES))
    with pytest.raises(BadInput) as e:
        export(str(site), tmp_path / "out")
    assert f"{ckdir}: {why}" in str(e.value) and "\n" not in str(e.value)
    assert not marker.exists()


def test_export_takes_the_runs_key_from_the_control_plane_not_from_the_run_tree(tmp_path: Path):
    from dilococtl.errors import BadInput
    from dilococtl.export import checkpoint_key

    site = _site(tmp_path, "../../planted")  # a run id that would lead outside run_ca/
    with pytest.raises(BadInput, match="no checkpoint key for run '../../planted'"):
        checkpoint_key(site)
    from dilococtl.plan import run_ca_dir

    site2 = _site(tmp_path / "b", "r2")
    key = make_key(run_ca_dir("r2") / KEY_FILE)
    assert checkpoint_key(site2) == key


# --- resume's node-side probe ---------------------------------------------------------------------


def test_resume_probe_refuses_what_the_run_key_did_not_sign(tmp_path: Path):
    import subprocess
    import sys

    from dilococtl.resume import CKPT_PROBE

    key_file = tmp_path / KEY_FILE
    key = make_key(key_file)
    ck = Checkpointer(tmp_path / "ck", keep=5, async_save=False, key=key)
    for rnd in (1, 2, 3):
        ck.save(rnd, {"w": torch.arange(8.0) * rnd})
    forged = round_dir(tmp_path / "ck", 2)  # a complete checkpoint, signed with someone else's key
    m = json.loads((forged / MANIFEST).read_text())
    (forged / MANIFEST).write_text(json.dumps(sign({k: v for k, v in m.items() if k != "signature"},
                                                   os.urandom(KEY_BYTES))))
    marker = tmp_path / "pwned"
    _plant(round_dir(tmp_path / "ck", 3), marker, "unsigned", key)
    out = subprocess.run([sys.executable, "-c", CKPT_PROBE, str(tmp_path / "ck"), str(key_file)],
                         capture_output=True, text=True, check=True).stdout
    got = {c["round"]: c["why"] for c in json.loads(out)}
    assert got == {r: verify(round_dir(tmp_path / "ck", r), key) for r in (1, 2, 3)}
    assert got[1] == "" and got[2].startswith("signature does not verify") and got[3].startswith("unsigned checkpoint")
    assert verify(forged, key) == got[2] and not marker.exists()
    r = subprocess.run([sys.executable, "-c", CKPT_PROBE, str(tmp_path / "ck"), str(tmp_path / "nokey")],
                       capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip() == f"no checkpoint key at {tmp_path / 'nokey'}: No such file or directory"
