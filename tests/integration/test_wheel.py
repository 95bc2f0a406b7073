"""The wheel carries the example specs the help names, and the CLI finds them from an install.

`dilococtl launch playbooks/local-2site.toml` is the example of `dilococtl --help`; outside the
repository there is no playbooks/ directory, so the wheel ships the repository's playbooks/ as
package data (dilococtl/playbooks, a link to it) and the CLI falls back to that copy.

The wheel is built offline from a copy of the tree (no build isolation: setuptools from this
interpreter), then unzipped and run with PYTHONPATH pointing at it (installing would pull torch).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLAYBOOKS = sorted(p.relative_to(ROOT / "playbooks").as_posix()
                   for p in (ROOT / "playbooks").rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist")
    for name in ("dilococtl", "trainer", "playbooks"):
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=skip)  # dilococtl/playbooks stays a link
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "--disable-pip-version-check", "-q", "-w", str(tmp / "dist"), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = (tmp / "dist").glob("dilococtl-*.whl")
    return whl


def test_the_wheel_carries_every_playbook(wheel):
    assert PLAYBOOKS and "local-2site.toml" in PLAYBOOKS
    with zipfile.ZipFile(wheel) as z:
        for name in PLAYBOOKS:
            assert z.read(f"dilococtl/playbooks/{name}") == (ROOT / "playbooks" / name).read_bytes(), name
        assert not [n for n in z.namelist() if n.startswith("playbooks/")]  # in the package, not beside it


def test_the_cli_of_the_wheel_runs_a_bundled_playbook_where_there_is_no_playbooks_dir(wheel, tmp_path):
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    cwd = tmp_path / "elsewhere"  # no playbooks/ here
    cwd.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "DILOCOCTL_HOME": str(tmp_path / "home"), "COLUMNS": "200"}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "dilococtl", *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=120)

    where = subprocess.run([sys.executable, "-c", "import dilococtl; print(dilococtl.__file__)"],
                           cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert Path(where.stdout.strip()).parent == site / "dilococtl", where.stdout + where.stderr  # not the checkout

    check = cli("spec", "check", "playbooks/local-2site.toml")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "spec OK" in check.stdout
    assert str(site / "dilococtl" / "playbooks" / "local-2site.toml") in check.stderr  # the note names the copy

    dry = cli("launch", "--dry-run", "--json", "playbooks/local-2site.toml")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    plan = json.loads(dry.stdout)
    assert sorted(n["site"] for n in plan["nodes"]) == ["site-a", "site-b"]

    missing = cli("spec", "check", "playbooks/no-such-playbook.toml")  # not bundled: the usual error
    assert missing.returncode != 0 and "no such run spec" in missing.stdout + missing.stderr
