"""[[sites]] scheduler = "slurm" in the run spec: the playbook checks, bad keys are one line each."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomlkit

from dilococtl.errors import BadInput
from dilococtl.slurm.config import slurm_site
from dilococtl.spec import load_spec
from dilococtl.spec_sites import refuse_slurm_sites
from dilococtl.spec_summary import summary
from dilococtl.spec_types import SpecError

PLAYBOOK = Path(__file__).resolve().parents[2] / "playbooks" / "h100-slurm.toml"


def test_slurm_playbook_checks_and_counts_its_allocations():
    spec = load_spec(PLAYBOOK)
    s = summary(spec)
    assert [x["scheduler"] for x in s["sites"]] == ["slurm", "slurm", "slurm", "ssh"]
    assert (s["nodes"], s["processes"]) == (32, 256)
    assert s["lighthouse"].startswith("http://sae-gpu01.example.net:")  # the SSH site's first host
    us = slurm_site(spec.sites[0])
    assert (us.login, us.partition, us.account, us.qos, us.nodes, us.time_limit, us.sbatch_args) == \
        ("login.use.example.net", "h100", "llm-pretrain", "high", 8, "1-00:00:00", ["--exclusive"])
    # tune-h probes links and benchmarks steps on each site's first host: not on a Slurm site's allocation
    with pytest.raises(BadInput, match=r"^sites\[0\] \(us-east\) is a Slurm site: `dilococtl tune-h` does not"):
        refuse_slurm_sites(spec, "tune-h")


def _mutated(tmp_path: Path, site: int, **kv) -> Path:
    doc = tomlkit.parse(PLAYBOOK.read_text())
    for k, v in kv.items():
        if v is None:
            del doc["sites"][site][k]
        else:
            doc["sites"][site][k] = v
    p = tmp_path / "spec.toml"
    p.write_text(tomlkit.dumps(doc))
    return p


@pytest.mark.parametrize("site,kv,msg", [
    (0, dict(scheduler="pbs"), "sites[0].scheduler: must be one of ssh, slurm, got 'pbs'"),
    (0, dict(hosts=["n1"]), "sites[0].hosts: a Slurm site's nodes come from its allocation: set nodes, not hosts"),
    (0, dict(login=None), "sites[0].login: a Slurm site needs its login node"),
    (0, dict(login="a b"), "sites[0].login: not a host name or address"),
    (0, dict(time_limit="1 day"), "sites[0].time_limit: bad Slurm time '1 day'"),
    (0, dict(nodes=0), "sites[0].nodes: must be in [1, 100000], got 0"),
    (0, dict(sbatch_args=["--account=x"]), "sites[0].sbatch_args[0]: --account is set by the site's own keys"),
    (3, dict(partition="gpu"), 'sites[3].partition: only for scheduler = "slurm" sites'),
    (3, dict(nodes=8), 'sites[3].nodes: only for scheduler = "slurm" sites'),
    (3, dict(hosts=None), "sites[3].hosts: required key is missing"),
])
def test_bad_slurm_keys_are_one_line(tmp_path, site, kv, msg):
    with pytest.raises(SpecError) as e:
        load_spec(_mutated(tmp_path, site, **kv))
    assert msg in str(e.value) and "\n" not in str(e.value)
