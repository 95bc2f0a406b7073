"""bench/lab_modes.py without a lab: its arguments, the specs it derives from the lab's, its code snapshot."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomlkit

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("lab_modes", ROOT / "bench" / "lab_modes.py")
lab_modes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lab_modes)

# what `dilococtl lab up --sites 2 --spec-out` writes (lab 9cc8, trimmed of its comment)
LAB_SPEC = """\
[run]
name = "lab-9cc8"
lighthouse = "10.210.1.10"

[model]
preset = "tiny"

[data]
seq_len = 64
batch_size = 4
val_plays = 2

[train]
warmup_steps = 2
threads = 1
eval_batches = 2
device = "cpu"

[diloco]
h = 70
rounds = 4
sites = 2
min_sites = 1
link_mbit = 50.0

[checkpoint]
every_rounds = 1
keep = 2

[ssh]
user = "root"
port = 22
identity_file = "/tmp/x/lab/id_ed25519"
known_hosts = "/tmp/x/known_hosts"
connect_timeout_s = 5.0

[[sites]]
name = "site0"
hosts = ["10.210.1.10"]
python = "/usr/bin/python3"
work_dir = "/tmp/x/lab-work/9cc8/site0"

[[sites]]
name = "site1"
hosts = ["10.210.2.10"]
python = "/usr/bin/python3"
work_dir = "/tmp/x/lab-work/9cc8/site1"
"""


def spec_check(path: Path) -> dict:
    r = subprocess.run([sys.executable, "-m", "dilococtl", "spec", "check", str(path), "--json"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("argv, word", [(["--rounds", "0"], "--rounds"), (["--rounds", "ten"], "--rounds"),
                                        (["--rounds", "", "--steps", ""], "--rounds"),
                                        (["--modes", "sync,ddp"], "unknown ddp")])
def test_bad_arguments_exit_2_with_one_line_before_any_lab(argv, word, capsys):
    assert lab_modes.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and word in err[0], err


def test_the_arms_differ_only_in_name_and_mode_and_leave_the_outer_optimizer_unset(tmp_path):
    base = tmp_path / "lab.toml"
    base.write_text(LAB_SPEC)
    lab_modes.edit_spec(base, base, {**lab_modes.RUN_KNOBS, "train": {**lab_modes.RUN_KNOBS["train"], "seed": 3}})
    docs = {}
    for mode in lab_modes.MODES:
        arm = tmp_path / f"{mode}.toml"
        lab_modes.edit_spec(base, arm, {"run": {"name": f"lab-{mode}"}, "diloco": {"mode": mode, "rounds": 9}})
        doc = tomlkit.parse(arm.read_text()).unwrap()
        assert "outer_lr" not in doc["diloco"] and "outer_momentum" not in doc["diloco"]
        docs[mode] = doc
        assert spec_check(arm)["mode"] == mode
    for doc in docs.values():
        del doc["run"]["name"], doc["diloco"]["mode"]
    assert docs["sync"] == docs["overlap"] == docs["async"]
    assert docs["sync"]["train"]["seed"] == 3 and docs["sync"]["data"]["batch_size"] == 8


def test_the_local_ddp_arm_is_the_lab_run_on_this_machine_at_equal_tokens(tmp_path):
    lab = tmp_path / "lab.toml"
    lab.write_text(LAB_SPEC)
    lab_modes.edit_spec(lab, lab, {"diloco": {"rounds": 9}})
    local = tmp_path / "ddp.toml"
    lab_modes.local_spec(lab, local, tmp_path / "work", None)
    lab_modes.edit_spec(local, local, {"run": {"name": "ddp"}, "diloco": {"algorithm": "ddp"}})
    want, got = spec_check(lab), spec_check(local)
    assert got["algorithm"] == "ddp" and [s["hosts"] for s in got["sites"]] == [["local"], ["local"]]
    assert (got["h"], got["rounds"], got["tokens_total"], got["params"]) == \
        (want["h"], want["rounds"], want["tokens_total"], want["params"])
    assert got["lighthouse"].endswith(f":{lab_modes.LOCAL_LIGHTHOUSE_PORT}")  # off the default 29510
    doc = tomlkit.parse(local.read_text())
    assert "ssh" not in doc and doc["sites"][1]["work_dir"] == str(tmp_path / "work" / "site1")


def test_the_snapshot_is_what_the_nodes_import(tmp_path):
    src, commit, wrapper = lab_modes.snapshot("HEAD", tmp_path)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert commit == head and (src / "trainer" / "modes" / "loop.py").is_file()
    # the sites' `python`: a node's ssh session has no PYTHONPATH of ours, the wrapper brings it
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([wrapper, "-c", "import trainer, dilococtl; print(trainer.__file__, dilococtl.__file__)"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert all(Path(p).is_relative_to(src) for p in r.stdout.split()), r.stdout
