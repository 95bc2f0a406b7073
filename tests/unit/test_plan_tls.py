"""launch's plan with the TLS transport: the run's CA, one identity per site, only paths in configs."""

from __future__ import annotations

import stat
import tomllib

import pytest

from dilococtl import plan as plan_mod
from dilococtl.spec import spec_from_dict


def spec(tmp_path, hosts=("local", "local"), **diloco):
    data = {"run": {"name": "t1"}, "diloco": {"transport": "tls", **diloco},
            "sites": [{"name": f"dc-{i}", "hosts": [h], "work_dir": str(tmp_path / "w")} for i, h in enumerate(hosts)]}
    return spec_from_dict(data, "t1.toml")


def test_local_sites_read_their_own_identity_in_place(tmp_path):
    plan = plan_mod.build(spec(tmp_path), "RID")
    d = plan_mod.run_ca_dir("RID")
    for n in plan.nodes:
        run = tomllib.loads(n.config_toml)["run"]
        assert run["tls_ca"] == str(d / "ca.crt")
        assert (run["tls_cert"], run["tls_key"]) == (str(d / "sites" / f"{n.site}.crt"), str(d / "sites" / f"{n.site}.key"))
        assert run["transport_host"] == "127.0.0.1"
        assert stat.S_IMODE((d / "sites" / f"{n.site}.key").stat().st_mode) == 0o600
        key = (d / "sites" / f"{n.site}.key").read_text()
        assert all(key not in m.config_toml and key not in m.command for m in plan.nodes)
    assert plan.files == []
    assert (d / "ca.key").read_text() not in plan.nodes[0].config_toml


def test_remote_sites_get_copies_of_the_ca_cert_and_their_own_identity_only(tmp_path):
    plan = plan_mod.build(spec(tmp_path, hosts=("10.9.0.2", "10.9.0.3")), "RID2")
    by_host = {}
    for host, remote, local in plan.files:
        by_host.setdefault(host, []).append((remote, local.name))
    assert sorted(by_host) == ["10.9.0.2", "10.9.0.3"]
    names = sorted(name for _, name in by_host["10.9.0.2"])
    # never the CA's key, never another site's key; the run's checkpoint signing key (issue 34)
    assert names == ["ca.crt", "checkpoint.key", "dc-0.crt", "dc-0.key"]
    run = tomllib.loads(plan.nodes[1].config_toml)["run"]
    assert run["tls_key"].endswith("/_keys/dc-1.key") and run["transport_host"] == "10.9.0.3"


def test_a_dry_run_makes_no_certificates(tmp_path):
    plan_mod.build(spec(tmp_path), "RID3", make_keys=False)
    assert not plan_mod.run_ca_dir("RID3").exists()


def test_the_default_transport_is_tls_for_a_launched_run_and_an_error_without_an_identity(tmp_path):
    from trainer.rules.config import cross_site_transport, from_dict
    from trainer.rules.tables import ConfigError

    data = {"run": {"name": "t4"}, "sites": [{"name": f"dc-{i}", "hosts": ["local"], "work_dir": str(tmp_path / "w")}
                                           for i in range(2)]}
    plan = plan_mod.build(spec_from_dict(data, "t4.toml"), "RID4")  # no transport key: the default
    cfg = from_dict(tomllib.loads(plan.nodes[0].config_toml))
    assert cfg.diloco.transport == "auto" and cross_site_transport(cfg) == "tls"
    with pytest.raises(ConfigError, match="no run.tls_ca, run.tls_cert, run.tls_key"):
        cross_site_transport(from_dict({}))  # a trainer started by hand, no certificates: never a silent gloo
    data["diloco"] = {"transport": "gloo"}  # kept for comparison: no identities made
    plan = plan_mod.build(spec_from_dict(data, "t4.toml"), "RID5")
    assert tomllib.loads(plan.nodes[0].config_toml)["run"].get("tls_cert", "") == ""
    assert sorted(p.name for p in plan_mod.run_ca_dir("RID5").iterdir()) == ["checkpoint.key"]  # no CA, no identity
