"""The trainer's entry refuses bad input at start: one line naming the field, exit 2, nothing written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_trainer(tmp_path: Path, toml: str) -> subprocess.CompletedProcess:
    cfg = tmp_path / "c.toml"
    cfg.write_text(toml + f'\n[run]\nrun_dir = "{tmp_path / "run"}"\n')
    return subprocess.run([sys.executable, "-m", "trainer", "--config", str(cfg)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("toml, needle", [
    ("[diloco]\nhh = 3", "diloco.hh: unknown key"),
    ("[diloco]\nh = -5", "diloco.h: must be > 0, got -5"),
    ("[train]\nlr = \"fast\"", "train.lr: expected float"),
    ("[model]\npreset = \"huge\"", "model.preset: unknown preset 'huge'"),
    ("[diloco]\ncompression = \"zip\"", "diloco.compression: unknown codec 'zip'"),
    ("[data]\nsource = \"shards\"\npath = \"/nonexistent/corpus\"", "data.path"),
    ("[modle]\npreset = \"tiny\"", "modle: unknown key"),
])
def test_bad_config_fails_at_start_with_one_line(tmp_path, toml, needle):
    r = run_trainer(tmp_path, toml)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert not (tmp_path / "run").exists()  # no metrics, no checkpoints: nothing was started


def test_missing_config_file(tmp_path):
    r = subprocess.run([sys.executable, "-m", "trainer", "--config", str(tmp_path / "nope.toml")], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no such config file" in r.stderr
