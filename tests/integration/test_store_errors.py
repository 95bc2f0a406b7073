"""A damaged, locked or unwritable state.db: one line naming the file and what to do, exit 1."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dilococtl import db as db_mod
from dilococtl.errors import StoreError
from dilococtl.spec import spec_from_dict
from dilococtl.store import Store

REPO = Path(__file__).resolve().parents[2]


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DILOCOCTL_HOME": str(home)}
    env.pop("DILOCOCTL_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "dilococtl", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=env)


def test_a_damaged_store_names_the_file_and_the_way_out(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    db = home / "state.db"
    db.write_bytes(b"this is no SQLite database, it was overwritten " * 20)
    for args in (["runs"], ["status"]):
        r = _cli(home, *args)
        assert r.returncode == 1, r.stderr
        # before: "error: internal error: DatabaseError: file is not a database"
        assert r.stderr == (f"error: {db}: the store is damaged (file is not a database); move it aside "
                            f"(mv {db} {db}.damaged) and dilococtl starts a new one, or restore a copy\n")


def test_a_store_that_cannot_be_opened_names_the_file(tmp_path):
    home = tmp_path / "home"
    (home / "state.db").mkdir(parents=True)  # as root no permission bit stops a write: a directory does
    r = _cli(home, "runs")
    assert r.returncode == 1
    assert r.stderr.startswith(f"error: {home / 'state.db'}: the store cannot be opened or written "
                               "(unable to open database file); make ")
    assert r.stderr.count("\n") == 1 and "DILOCOCTL_HOME" in r.stderr


@pytest.fixture
def locker(tmp_path, request):
    """Hold the write lock of a store (as another dilococtl in the middle of a write would); with
    exclusive=True also keep other connections from opening it (locking_mode EXCLUSIVE)."""
    exclusive = getattr(request, "param", True)
    path = tmp_path / "state.db"
    Store.open(path).close()  # created and migrated
    holding, release = threading.Event(), threading.Event()

    def hold():
        c = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        if exclusive:
            c.execute("PRAGMA locking_mode = EXCLUSIVE")
        c.execute("BEGIN EXCLUSIVE")
        c.execute("CREATE TABLE IF NOT EXISTS held (x)")
        holding.set()
        release.wait(30)
        c.execute("ROLLBACK")
        c.close()

    t = threading.Thread(target=hold, daemon=True)
    yield path, t, holding
    release.set()
    t.join(10)


def test_a_locked_store_at_open_says_who_to_wait_for(locker, monkeypatch):
    path, t, holding = locker
    monkeypatch.setattr(db_mod, "BUSY_TIMEOUT_S", 0.3)
    t.start()
    assert holding.wait(10)
    with pytest.raises(StoreError) as err:
        Store.open(path)
    assert str(err.value) == (f"{path}: the store is locked by another process for 0.3s (database is locked); "
                              f"let it finish (`fuser {path}` names it) and try again")


@pytest.mark.parametrize("locker", [False], indirect=True)
def test_a_store_locked_in_the_middle_of_a_command_is_one_line_too(locker, tmp_path, monkeypatch):
    path, t, holding = locker
    monkeypatch.setattr(db_mod, "BUSY_TIMEOUT_S", 0.3)
    spec = spec_from_dict({"run": {"name": "l"}, "sites": [{"name": "a", "hosts": ["local"]}]}, "spec.toml")
    with pytest.raises(StoreError, match=r"the store is locked by another process .* \(database is locked\)"):
        with Store.open(path) as store:
            t.start()
            assert holding.wait(10)
            store.create_run(spec)


def test_a_home_that_is_a_file_is_one_line(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.write_text("not a directory")
    monkeypatch.setenv("DILOCOCTL_HOME", str(home))
    with pytest.raises(StoreError) as err:  # before: a raw FileExistsError
        Store.open()
    assert str(err.value).startswith(f"{home}: not a directory, where dilococtl keeps its records ([Errno 17]")
    assert str(err.value).endswith("set DILOCOCTL_HOME to a directory")
