"""Issue 34, findings 4 and 9: the control plane's files are the user's only, and keys die with the run.

~/.dilococtl 0700 and state.db (+ -wal/-shm) 0600, fixed on open when older runs left 0755/0644; a
work_dir another user owns or may write is refused in one line; the default work_dir is under the
user's home, not /tmp; an ended run's CA and site keys are deleted, its checkpoint key kept; `runs rm
--files` deletes every key of the run; the checkpoint key reaches the trainers by path only.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from dilococtl import paths, run_ca
from dilococtl.errors import BadInput


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def _foreign_dir(tmp_path: Path) -> Path:
    """A directory owned by another user: made and chowned as root, else one the system owns."""
    if os.geteuid() == 0:
        d = tmp_path / "theirs"
        d.mkdir(mode=0o755)
        os.chown(d, 65534, 65534)
        return d
    return Path("/")


def test_home_is_made_0700_and_an_old_0755_home_is_fixed(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("DILOCOCTL_HOME", str(tmp_path / "h"))
    assert _mode(paths.home()) == 0o700
    os.chmod(tmp_path / "h", 0o755)  # what earlier versions left
    paths.home()
    assert _mode(tmp_path / "h") == 0o700
    assert _mode(paths.runs_dir()) == 0o700


def test_home_owned_by_another_user_is_refused(tmp_path: Path, monkeypatch):
    theirs = _foreign_dir(tmp_path)
    monkeypatch.setenv("DILOCOCTL_HOME", str(theirs))
    with pytest.raises(BadInput, match=r"owned by uid \d+, not by this user .*refusing to use it"):
        paths.home()


def test_store_files_are_0600_and_old_0644_ones_are_fixed(tmp_path: Path):
    from dilococtl.store import Store

    db = tmp_path / "h" / "state.db"
    s = Store.open(db)
    s.db.conn.execute("CREATE TABLE IF NOT EXISTS t (x)")
    s.db.conn.execute("INSERT INTO t VALUES (1)")
    s.db.conn.commit()
    for suffix in ("", "-wal", "-shm"):
        assert _mode(Path(f"{db}{suffix}")) == 0o600, suffix
    s.close()
    for suffix in ("", "-wal", "-shm"):
        if Path(f"{db}{suffix}").exists():
            os.chmod(f"{db}{suffix}", 0o644)
    Store.open(db).close()
    assert _mode(db) == 0o600
    assert all(_mode(Path(f"{db}{x}")) == 0o600 for x in ("-wal", "-shm") if Path(f"{db}{x}").exists())


def _spec(tmp_path: Path, work_dir: str | None, host: str = "local", user: str = ""):
    from dilococtl.spec import spec_from_dict

    site = {"name": "a", "hosts": [host]}
    if work_dir is not None:
        site["work_dir"] = work_dir
    data = {"run": {"name": "p"}, "diloco": {"transport": "gloo"}, "ssh": {"user": user} if user else {},
            "sites": [site, {**site, "name": "b", "hosts": [host if host == "local" else "10.0.0.9"]}]}
    return spec_from_dict(data, "p.toml")


def test_default_work_dir_is_under_the_users_home_not_tmp(tmp_path: Path):
    spec = _spec(tmp_path, None)
    assert spec.sites[0].work_dir == str(Path(os.environ["DILOCOCTL_HOME"]) / "work")
    assert _spec(tmp_path, None, host="10.0.0.8", user="alice").sites[0].work_dir == "/home/alice/.dilococtl/work"
    assert _spec(tmp_path, None, host="10.0.0.8", user="root").sites[0].work_dir == "/root/.dilococtl/work"


def test_a_work_dir_another_user_owns_or_may_write_is_refused(tmp_path: Path):
    from dilococtl.spec_types import SpecError

    theirs = _foreign_dir(tmp_path)
    with pytest.raises(SpecError, match=rf"sites\[0\]\.work_dir: {theirs}: owned by uid \d+, not by this user"):
        _spec(tmp_path, str(theirs))
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(SpecError, match=r"mode 777 lets other users write it: refusing to use it \(chmod go-w\)"):
        _spec(tmp_path, str(shared))
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    os.chmod(open_parent, 0o777)  # no sticky bit: anyone could make work_dir there first
    with pytest.raises(SpecError, match="does not exist and its parent .* lets other users create it"):
        _spec(tmp_path, str(open_parent / "w"))
    assert _spec(tmp_path, str(tmp_path / "mine")).sites[0].work_dir == str(tmp_path / "mine")


def test_launch_plan_makes_local_work_dir_private_and_delivers_the_checkpoint_key_by_path(tmp_path: Path):
    import tomllib

    from dilococtl import plan as plan_mod

    work = tmp_path / "w"
    plan = plan_mod.build(_spec(tmp_path, str(work)), "RK1")
    key = plan_mod.run_ca_dir("RK1") / "checkpoint.key"
    assert _mode(work) == 0o700 and _mode(key) == 0o600 and len(key.read_bytes()) == 32
    assert _mode(plan_mod.run_ca_dir("RK1")) == 0o700
    secret = key.read_bytes()
    for n in plan.nodes:
        assert f"{run_ca.CHECKPOINT_KEY_ENV}={key}" in n.command
        assert secret.hex() not in n.command and secret.hex() not in n.config_toml
        assert "checkpoint" in tomllib.loads(n.config_toml)
    assert plan_mod.build(_spec(tmp_path, str(work)), "RK1") and key.read_bytes() == secret  # never replaced

    remote = plan_mod.build(_spec(tmp_path, "/srv/w", host="10.0.0.8"), "RK2")
    copies = [(h, r, src) for h, r, src in remote.files if r.endswith("checkpoint.key")]
    assert sorted(h for h, _, _ in copies) == ["10.0.0.8", "10.0.0.9"]
    assert all(r == "/srv/w/runs/RK2/_keys/checkpoint.key" for _, r, _ in copies)
    assert "DILOCO_CHECKPOINT_KEY=/srv/w/runs/RK2/_keys/checkpoint.key" in remote.nodes[0].command


def test_launch_refuses_a_local_work_dir_someone_else_made_first(tmp_path: Path):
    from dilococtl import plan as plan_mod

    theirs = _foreign_dir(tmp_path)
    if theirs == Path("/"):
        pytest.skip("needs root to make a directory owned by another user")  # CI runs as root
    spec = _spec(tmp_path, str(tmp_path / "later"))
    spec.sites[0].work_dir = spec.sites[1].work_dir = str(theirs)  # made by another user after the check
    with pytest.raises(BadInput, match="owned by uid 65534, not by this user"):
        plan_mod.build(spec, "RK3")


def test_checkpoint_key_constants_match_the_trainer():
    from trainer.checkpoints import checkpoint_trust

    assert (run_ca.CHECKPOINT_KEY, run_ca.CHECKPOINT_KEY_BYTES, run_ca.CHECKPOINT_KEY_ENV) == \
        (checkpoint_trust.KEY_FILE, checkpoint_trust.KEY_BYTES, checkpoint_trust.KEY_ENV)


def test_an_ended_run_loses_its_ca_and_site_keys_but_keeps_its_checkpoint_key(tmp_path: Path):
    d = tmp_path / "ca"
    first = run_ca.ensure(d, "R", ["a", "b"])
    ck = run_ca.ensure_checkpoint_key(d)
    secret = ck.read_bytes()
    gone = run_ca.retire(d)
    assert sorted(p.name for p in gone) == ["a.key", "b.key", "ca.key"]
    assert not (d / "ca.key").exists() and not first["a"].key.exists()
    assert (d / "ca.crt").exists() and first["a"].cert.exists() and ck.read_bytes() == secret
    old_ca = (d / "ca.crt").read_bytes()
    again = run_ca.ensure(d, "R", ["a", "b"])  # a resume: a new CA, every site re-issued
    assert again["a"].key.exists() and (d / "ca.crt").read_bytes() != old_ca
    assert run_ca.ensure_checkpoint_key(d).read_bytes() == secret


def test_stop_retires_the_keys_and_runs_rm_files_removes_them_all(tmp_path: Path):
    from dilococtl import plan as plan_mod
    from dilococtl import records
    from dilococtl.runs import stop
    from dilococtl.states import RunState
    from dilococtl.store import Store

    spec = _spec(tmp_path, str(tmp_path / "w"))
    store = Store.open()
    run = store.create_run(spec, state=RunState.RUNNING)
    d = plan_mod.run_ca_dir(run.id)
    run_ca.ensure(d, run.id, ["a", "b"])
    run_ca.ensure_checkpoint_key(d)
    (plan_mod.service_keys_dir(run.id)).mkdir(parents=True)
    (plan_mod.service_keys_dir(run.id) / "token").write_text("t")
    run = stop(run, store=store, grace_s=0, force=True)
    assert run.state == RunState.STOPPED
    assert sorted(p.name for p in d.rglob("*.key")) == ["checkpoint.key"]
    out = records.remove_runs(store, [run], files=True)
    assert f"local:{d}" in out[0].files and f"local:{plan_mod.service_keys_dir(run.id)}" in out[0].files
    assert not d.exists() and not plan_mod.service_keys_dir(run.id).exists()
    store.close()
