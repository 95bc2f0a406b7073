"""A remote site's trainers reach the checkpoint store with this shell's AWS keys, never on a command line."""

from __future__ import annotations

import stat

from dilococtl import plan as plan_mod
from dilococtl.spec import spec_from_dict

SECRET = "s3cr3t-Do-Not-Log-0123456789abcdef"


def _spec(tmp_path, hosts):
    data = {"run": {"name": "c1"}, "checkpoint": {"store": "s3://bucket/ck"},
            "sites": [{"name": f"dc-{i}", "hosts": [h], "work_dir": str(tmp_path / "w")} for i, h in enumerate(hosts)]}
    return spec_from_dict(data, "c1.toml")


def test_remote_sites_get_a_private_credentials_file_by_path(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIATEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://10.9.0.9:8333")
    plan = plan_mod.build(_spec(tmp_path, ("10.9.0.2", "10.9.0.3")), "RIDC")
    creds = [(h, remote, local) for h, remote, local in plan.files if remote.endswith("/_keys/aws-credentials")]
    assert sorted(h for h, _, _ in creds) == ["10.9.0.2", "10.9.0.3"]
    for node in plan.nodes:
        (_, there, local) = next(c for c in creds if c[0] == node.host)
        assert stat.S_IMODE(local.stat().st_mode) == 0o600 and SECRET in local.read_text()
        assert f"AWS_SHARED_CREDENTIALS_FILE={there}" in node.command
        assert "AWS_ENDPOINT_URL_S3=http://10.9.0.9:8333" in node.command
        assert SECRET not in node.command and SECRET not in node.config_toml and "AKIATEST" not in node.command
    local = plan_mod.build(_spec(tmp_path, ("local", "local")), "RIDL")
    assert local.files == [] or not [f for f in local.files if f[1].endswith("aws-credentials")]
    assert all("AWS_SHARED_CREDENTIALS_FILE" not in n.command for n in local.nodes)  # local sites inherit the env


def test_nothing_shipped_without_keys_in_the_shell_or_in_a_dry_run(tmp_path, monkeypatch):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k, raising=False)
    plan = plan_mod.build(_spec(tmp_path, ("10.9.0.2", "10.9.0.3")), "RIDD")
    assert not [f for f in plan.files if f[1].endswith("aws-credentials")]  # the nodes' own chain
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIATEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    plan_mod.build(_spec(tmp_path, ("10.9.0.2", "10.9.0.3")), "RIDE", make_keys=False)
    assert not (plan_mod.run_ca_dir("RIDE") / "aws-credentials").exists()
