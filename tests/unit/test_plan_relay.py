"""launch's plan puts the Lighthouse on loopback behind a mutual-TLS relay with the TLS transport, and
leaves it as it was with gloo."""

from __future__ import annotations

import tomllib

import pytest

from dilococtl import plan as plan_mod
from dilococtl.errors import BadInput
from dilococtl.spec import spec_from_dict
from dilococtl.spec_sites import lighthouse_site


def spec(tmp_path, hosts=("local", "local"), lighthouse="", names=None, **diloco):
    names = names or [f"dc-{i}" for i in range(len(hosts))]
    data = {"run": {"name": "t1", "lighthouse": lighthouse, "lighthouse_port": 29555}, "diloco": diloco,
            "sites": [{"name": n, "hosts": [h], "work_dir": str(tmp_path / "w")} for n, h in zip(names, hosts, strict=True)]}
    return spec_from_dict(data, "t1.toml")


def test_tls_the_lighthouse_binds_loopback_and_the_relay_takes_its_port_with_the_hosting_sites_identity(tmp_path):
    plan = plan_mod.build(spec(tmp_path, hosts=("10.9.0.2", "10.9.0.3")), "R1")
    lh = plan.lighthouse
    assert "--bind 127.0.0.1:0 " in lh.command and lh.command.endswith(" --door")
    assert lh.relay.command_for("/tmp/dilococtl-lh-x/door").endswith(" --local --target unix:/tmp/dilococtl-lh-x/door")
    relay = lh.relay.command_for(4321)
    assert "-m trainer.transport.relay --bind 0.0.0.0:29555 --site dc-0 " in relay
    assert relay.endswith("--allow dc-0,dc-1 --local --target 127.0.0.1:4321")
    # the relay on dc-0's host reads the very files dc-0's trainer gets: no other key goes there
    assert f"--key {plan.nodes[0].config_toml.split('tls_key = ')[1].split()[0].strip(chr(34))} " in relay
    assert sorted(r.rsplit("/", 1)[1] for h, r, _ in plan.files if h == "10.9.0.2") == ["ca.crt", "checkpoint.key", "dc-0.crt", "dc-0.key"]
    for n in plan.nodes:
        run = tomllib.loads(n.config_toml)["run"]
        assert run["lighthouse"] == "http://10.9.0.2:29555" and run["lighthouse_site"] == "dc-0"


def test_a_lighthouse_outside_every_site_gets_an_identity_of_its_own(tmp_path):
    s = spec(tmp_path, hosts=("10.9.0.2", "10.9.0.3"), lighthouse="10.9.0.9")
    assert lighthouse_site(s) == "lighthouse"
    plan = plan_mod.build(s, "R2")
    assert "--site lighthouse " in plan.lighthouse.relay.command
    assert sorted(r.rsplit("/", 1)[1] for h, r, _ in plan.files if h == "10.9.0.9") == \
        ["ca.crt", "lighthouse.crt", "lighthouse.key"]
    assert tomllib.loads(plan.nodes[1].config_toml)["run"]["lighthouse_site"] == "lighthouse"


def test_a_site_named_like_that_identity_is_refused_with_a_lighthouse_outside_the_sites(tmp_path):
    with pytest.raises(BadInput, match="run.lighthouse: .*'lighthouse', which a site already names"):
        spec(tmp_path, hosts=("10.9.0.2", "10.9.0.3"), lighthouse="10.9.0.9", names=["lighthouse", "b"])
    spec(tmp_path, hosts=("10.9.0.2", "10.9.0.3"), names=["lighthouse", "b"])  # its own host: fine


@pytest.mark.parametrize("diloco", [{"transport": "gloo"}, {"mode": "async"}])
def test_gloo_and_async_keep_the_lighthouse_or_service_on_its_public_port_without_relay(tmp_path, diloco):
    plan = plan_mod.build(spec(tmp_path, hosts=("10.9.0.2", "10.9.0.3"), **diloco), "R3")
    assert plan.lighthouse.relay is None and "--bind 0.0.0.0:29555" in plan.lighthouse.command
    assert all(tomllib.loads(n.config_toml)["run"].get("lighthouse_site", "") == "" for n in plan.nodes)


def test_the_local_demo_relays_on_loopback(tmp_path):
    plan = plan_mod.build(spec(tmp_path), "R4")
    assert "--bind 127.0.0.1:0 " in plan.lighthouse.command
    assert "--bind 127.0.0.1:29555 --site dc-0 " in plan.lighthouse.relay.command and plan.files == []


def test_only_a_site_led_from_the_lighthouses_host_dials_its_loopback_port(tmp_path):
    plan = plan_mod.build(spec(tmp_path, hosts=("10.9.0.2", "10.9.0.3")), "R5")
    got = plan_mod.lighthouse_loopback_configs(plan, 4321)
    assert list(got) == ["dc-0"]
    run = tomllib.loads(got["dc-0"])["run"]
    assert run["lighthouse_loopback"] == "http://127.0.0.1:4321" and run["lighthouse_site"] == "dc-0"
    assert tomllib.loads(got["dc-0"])["diloco"] == tomllib.loads(plan.nodes[0].config_toml)["diloco"]
    assert plan_mod.lighthouse_loopback_configs(plan, 0) == {}  # a Lighthouse recorded before launch knew its port
    gloo = plan_mod.build(spec(tmp_path, hosts=("10.9.0.2", "10.9.0.3"), transport="gloo"), "R6")
    assert plan_mod.lighthouse_loopback_configs(gloo, 4321) == {}  # no relay to skip


@pytest.mark.parametrize("url", ["http://10.9.0.2:4321", "http://127.0.0.1:4321/x", "https://127.0.0.1:1",
                                 "http://localhost:4321", "http://127.0.0.1.evil:1", "http://127.0.0.1:4321\n"])
def test_a_loopback_lighthouse_url_that_is_not_this_hosts_loopback_is_refused(tmp_path, url):
    from trainer.rules.config import from_dict
    from trainer.rules.tables import ConfigError

    with pytest.raises(ConfigError, match="run.lighthouse_loopback: "):
        from_dict({"run": {"lighthouse_loopback": url}})
    assert from_dict({"run": {"lighthouse_loopback": "http://[::1]:80"}}).run.lighthouse_loopback
