"""Run spec loading and validation: every bad spec is one SpecError line naming the key."""

import copy
import json
from pathlib import Path

import pytest
import tomlkit
from typer.testing import CliRunner

from dilococtl.cli import app
from dilococtl.errors import EXIT_BAD_INPUT, BadInput
from dilococtl.spec import load_spec, spec_from_json, spec_to_json
from dilococtl.spec_sites import is_local, lighthouse_host, nproc_per_node, trainer_config
from dilococtl.spec_summary import summary
from dilococtl.spec_types import RunSpec, SiteSection, SpecError
from trainer.rules import config as tconfig
from trainer.rules.model_config import PRESETS, ModelConfig, param_count

PLAYBOOKS = Path(__file__).resolve().parents[2] / "playbooks"

BASE = {
    "run": {"name": "t"},
    "model": {"preset": "tiny"},
    "diloco": {"h": 10, "rounds": 2},
    "sites": [
        {"name": "a", "hosts": ["10.0.0.1", "10.0.0.2"], "nproc_per_node": 2},
        {"name": "b", "hosts": ["10.0.1.1"], "nproc_per_node": 4},  # 4 processes per site, as site a
    ],
}


def write(tmp_path: Path, data: dict) -> Path:
    p = tmp_path / "spec.toml"
    p.write_text(tomlkit.dumps(data))
    return p


def mutate(**changes):
    """A copy of BASE with `changes`: "table.key" -> value (None deletes), "sites[i].key" likewise."""
    def apply(d):
        for path, value in changes.items():
            if path.startswith("sites["):
                idx, key = int(path[6:path.index("]")]), path.split(".", 1)[1]
                target = d["sites"][idx]
            elif "." in path:
                table, key = path.split(".", 1)
                target = d.setdefault(table, {})
            else:
                target, key = d, path
            if value is None:
                target.pop(key)
            else:
                target[key] = value
        return d
    return apply


# (id, mutation of BASE, the message after "FILE: ")
BAD = [
    ("unknown-top", mutate(extra={"x": 1}), "extra: unknown key"),
    ("unknown-in-site", mutate(**{"sites[1].gpu": 1}), "sites[1].gpu: unknown key"),
    ("unknown-in-diloco", mutate(**{"diloco.hh": 5}), "diloco.hh: unknown key"),
    ("unknown-in-run", mutate(**{"run.nmae": "x"}), "run.nmae: unknown key"),
    ("wrong-type-h", mutate(**{"diloco.h": "20"}), "diloco.h: expected int, got '20'"),
    ("wrong-type-hosts", mutate(**{"sites[0].hosts": "10.0.0.1"}), "sites[0].hosts: expected a list of str"),
    ("wrong-type-host-item", mutate(**{"sites[0].hosts": ["10.0.0.1", 7]}), "sites[0].hosts[1]: expected str"),
    ("wrong-type-port", mutate(**{"ssh.port": "22"}), "ssh.port: expected int"),
    ("missing-run-name", mutate(**{"run.name": None}), "run.name: required key is missing"),
    ("missing-run", mutate(run=None), "run: required table [run] is missing"),
    ("missing-site-hosts", mutate(**{"sites[1].hosts": None}), "sites[1].hosts: required key is missing"),
    ("missing-sites", mutate(sites=None), "sites: at least one [[sites]] table is required"),
    ("h-zero", mutate(**{"diloco.h": 0}), "diloco.h: must be > 0, got 0"),
    ("h-negative", mutate(**{"diloco.h": -5}), "diloco.h: must be > 0, got -5"),
    ("dup-host", mutate(**{"sites[1].hosts": ["10.0.0.2"]}), "sites[1].hosts[0]: duplicate host '10.0.0.2' (also in sites[0])"),
    ("dup-host-in-site", mutate(**{"sites[1].hosts": ["h1", "H1"]}), "sites[1].hosts[1]: duplicate host 'H1' in site 'b'"),
    ("dup-site", mutate(**{"sites[1].name": "a"}), "sites[1].name: duplicate site name 'a'"),
    ("no-hosts", mutate(**{"sites[1].hosts": []}), "sites[1].hosts: a site needs at least one host"),
    ("diloco-sites", mutate(**{"diloco.sites": 3}), "diloco.sites: 3 does not match the 2 [[sites]] tables"),
    ("preset", mutate(**{"model.preset": "huge"}), "model.preset: unknown preset 'huge'"),
    ("compression", mutate(**{"diloco.compression": "zip"}), "diloco.compression: unknown codec 'zip'"),
    ("ef-decay", mutate(**{"diloco.error_feedback_decay": 1.5}), "diloco.error_feedback_decay: must be in [0, 1], got 1.5"),
    ("topk-block", mutate(**{"diloco.codec_topk_block": 70000}), "diloco.codec_topk_block: must be in [1, 65536], got 70000"),
    ("tp-nproc", mutate(**{"sites[0].tp": 3, "sites[0].nproc_per_node": 4}), "sites[0].tp: 3 does not divide nproc_per_node 4"),
    ("tp-pp", mutate(**{"sites[1].pp": 3}), "sites[1].pp: nodes * nproc_per_node = 4 is not divisible by tp * pp = 3"),
    ("tp-heads", mutate(**{"sites[0].tp": 4, "sites[0].nproc_per_node": 4}), "sites[0].tp: 4 does not divide the model's heads"),
    ("nproc-gpus", mutate(**{"sites[0].gpus_per_node": 2, "sites[0].nproc_per_node": 4}), "sites[0].nproc_per_node: 4 processes for 2 GPUs"),
    ("cuda-on-cpu", mutate(**{"train.device": "cuda"}), "train.device: 'cuda' but sites[0] (a) has gpus_per_node = 0"),
    ("port-high", mutate(**{"run.lighthouse_port": 70000}), "run.lighthouse_port: port must be in 1..65535, got 70000"),
    ("port-zero", mutate(**{"ssh.port": 0}), "ssh.port: port must be in 1..65535, got 0"),
    ("port-range", mutate(**{"run.base_port": 65535}), "run.base_port: 2 sites need ports 65535..65536"),
    ("port-clash", mutate(**{"run.lighthouse_port": 29601}), "run.lighthouse_port: 29601 collides"),
    ("relative-python", mutate(**{"sites[0].python": "venv/bin/python"}), "sites[0].python: must be an absolute path"),
    ("relative-workdir", mutate(**{"sites[1].work_dir": "tmp"}), "sites[1].work_dir: must be an absolute path"),
    ("mixed-local", mutate(**{"sites[1].hosts": ["local"]}), "sites: local and remote hosts cannot be mixed"),
    ("bad-name", mutate(**{"run.name": "my run"}), "run.name: use letters, digits"),
    ("shards-no-path", mutate(**{"data.source": "shards"}), "data.path: required when data.source is 'shards'"),
    ("sites-not-tables", mutate(sites=["a", "b"]), "sites: expected an array of [[sites]] tables"),
    ("link-pace-site", mutate(**{"diloco.transport_link_pace_mbit": {"a->c": 20.0}}),
     "diloco.transport_link_pace_mbit.'a->c': no site named 'c' (sites: a, b)"),
    ("link-pace-key", mutate(**{"diloco.transport_link_pace_mbit": {"a to b": 20.0}}),
     "diloco.transport_link_pace_mbit.'a to b': keys must be SRC->DST"),
    ("link-pace-nan", mutate(**{"diloco.transport_link_pace_mbit": {"a->b": float("nan")}}),
     "diloco.transport_link_pace_mbit.'a->b': must be a finite number"),
    ("unequal-processes", mutate(**{"sites[1].nproc_per_node": 2}), "sites[1]: 2 processes (nodes * nproc_per_node) where sites[0] has 4"),
    ("fragments-zero", mutate(**{"diloco.fragments": 0}), "diloco.fragments:"),
    ("sparse-merge", mutate(**{"diloco.compression": "sparseloco", "diloco.codec_sparse_merge": 100}),
     "diloco.codec_sparse_merge: must be in [1, 64], got 100"),
    ("preset-unknown", mutate(**{"diloco.compression": "sparse_loco"}), "diloco.compression: unknown codec 'sparse_loco'"),
]


@pytest.mark.parametrize("change,expected", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_spec_raises_one_line_naming_the_key(tmp_path, change, expected):
    path = write(tmp_path, change(copy.deepcopy(BASE)))
    with pytest.raises(SpecError) as err:
        load_spec(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: {expected}"), msg
    assert "\n" not in msg
    assert isinstance(err.value, BadInput) and err.value.exit_code == EXIT_BAD_INPUT


@pytest.mark.parametrize("change,expected", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_spec_check_cli_exits_2_with_the_line(tmp_path, change, expected):
    path = write(tmp_path, change(copy.deepcopy(BASE)))
    result = CliRunner().invoke(app, ["spec", "check", str(path)])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: {path}: {expected}")
    assert result.stderr.count("\n") == 1
    assert result.stdout == ""


def test_base_spec_is_valid_and_sites_count_is_filled_in(tmp_path):
    spec = load_spec(write(tmp_path, BASE))
    assert spec.diloco.sites == 2
    assert [s.name for s in spec.sites] == ["a", "b"]
    assert spec.sites[0].hosts == ["10.0.0.1", "10.0.0.2"]
    assert spec.path == str(tmp_path / "spec.toml")


def test_invalid_toml_and_missing_file(tmp_path):
    p = tmp_path / "broken.toml"
    p.write_text("[run\nname = 'x'\n")
    with pytest.raises(SpecError, match=rf"^{p}: invalid TOML: "):
        load_spec(p)
    with pytest.raises(SpecError, match="no such run spec"):
        load_spec(tmp_path / "absent.toml")


def test_local_host_may_serve_several_sites_but_once_per_site(tmp_path):
    ok = {"run": {"name": "l"}, "sites": [{"name": "a", "hosts": ["local"]}, {"name": "b", "hosts": ["localhost"]}]}
    assert load_spec(write(tmp_path, ok)).diloco.sites == 2
    bad = copy.deepcopy(ok)
    bad["sites"][0]["hosts"] = ["local", "127.0.0.1"]
    with pytest.raises(SpecError, match=r"sites\[0\]\.hosts\[1\]: duplicate host '127.0.0.1' in site 'a'"):
        load_spec(write(tmp_path, bad))


@pytest.mark.parametrize("name", ["local-2site.toml", "lab-3site.toml", "h100-4continents.toml"])
def test_playbooks_validate(name):
    spec = load_spec(PLAYBOOKS / name)
    assert spec.diloco.sites == len(spec.sites) >= 2
    for i in range(len(spec.sites)):
        cfg = trainer_config(spec, i, "r1", "/tmp/x/runs/r1")
        assert cfg.run.site_index == i and cfg.run.site == spec.sites[i].name


def test_local_playbook_is_two_local_cpu_sites():
    spec = load_spec(PLAYBOOKS / "local-2site.toml")
    assert [s.name for s in spec.sites] == ["site-a", "site-b"]
    assert all(s.hosts == ["local"] and s.python == "" and s.work_dir.startswith("/tmp") for s in spec.sites)
    assert lighthouse_host(spec) == "local"


def test_h100_playbook_has_32_nodes_of_8_gpus():
    spec = load_spec(PLAYBOOKS / "h100-4continents.toml")
    s = summary(spec)
    assert len(spec.sites) == 4
    assert s["nodes"] == 32 and s["processes"] == 256
    assert all(site.gpus_per_node == 8 and site.tp == 8 and nproc_per_node(site) == 8 for site in spec.sites)
    assert spec.model.preset == "1b" and spec.data.source == "shards"
    assert s["params"] == param_count(ModelConfig(preset="1b"))
    # one data-parallel replica per node (tp 8 = the node's 8 GPUs)
    assert [x["dp"] for x in s["sites"]] == [8, 8, 8, 8]
    assert s["tokens_per_round"] == 32 * spec.data.batch_size * spec.data.seq_len * spec.diloco.h


def test_nproc_per_node_rules():
    assert nproc_per_node(SiteSection(name="a", hosts=["h"])) == 1
    assert nproc_per_node(SiteSection(name="a", hosts=["h"], gpus_per_node=4)) == 4
    assert nproc_per_node(SiteSection(name="a", hosts=["h"], gpus_per_node=8, nproc_per_node=2)) == 2


def test_is_local():
    assert all(is_local(h) for h in ("local", "localhost", "127.0.0.1", "LOCAL"))
    assert not any(is_local(h) for h in ("10.0.0.1", "localhost.example.com", "127.0.0.2"))


def test_trainer_config_per_site_round_trips_through_the_trainer_loader(tmp_path):
    spec = load_spec(write(tmp_path, mutate(**{"run.lighthouse_port": 29999})(copy.deepcopy(BASE))))
    cfg = trainer_config(spec, 1, "20261129-083012-a1b2", "/srv/runs/x")
    assert (cfg.run.site, cfg.run.site_index, cfg.run.run_id, cfg.run.run_dir) == \
        ("b", 1, "20261129-083012-a1b2", "/srv/runs/x")
    assert cfg.run.lighthouse == "http://10.0.0.1:29999"
    assert cfg.diloco.sites == 2 and cfg.diloco.h == 10
    assert cfg.model.dim == PRESETS["tiny"][0]  # resolved for the trainer
    out = tmp_path / "trainer.toml"
    out.write_text(tconfig.dump_toml(cfg))
    assert tconfig.load(out) == cfg


def test_lighthouse_host_and_local_url(tmp_path):
    spec = load_spec(PLAYBOOKS / "local-2site.toml")
    assert trainer_config(spec, 0, "r", "/tmp/r").run.lighthouse == f"http://127.0.0.1:{spec.run.lighthouse_port}"
    remote = load_spec(write(tmp_path, mutate(**{"run.lighthouse": "10.9.9.9"})(copy.deepcopy(BASE))))
    assert lighthouse_host(remote) == "10.9.9.9"


def test_spec_json_round_trip():
    spec = load_spec(PLAYBOOKS / "h100-4continents.toml")
    back = spec_from_json(spec_to_json(spec))
    assert isinstance(back, RunSpec) and back == spec


def test_spec_check_prints_summary_and_json():
    path = PLAYBOOKS / "h100-4continents.toml"
    human = CliRunner().invoke(app, ["spec", "check", str(path)])
    assert human.exit_code == 0, human.output
    assert "4 sites, 32 nodes, 256 processes" in human.stdout
    assert "H 500" in human.stdout
    result = CliRunner().invoke(app, ["spec", "check", str(path), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["nodes"] == 32 and data["h"] == 500 and data["preset"] == "1b"
    assert data["params"] == param_count(ModelConfig(preset="1b"))


def test_spec_check_notes_a_topk_spec_with_the_outer_momentum(tmp_path):
    topk = {"diloco.compression": "topk:0.01+int8", "diloco.rounds": 10}  # 10 rounds: the rule's momentum is 0.5
    path = write(tmp_path, mutate(**topk)(copy.deepcopy(BASE)))
    result = CliRunner().invoke(app, ["spec", "check", str(path)])
    assert result.exit_code == 0, result.output
    assert "note: diloco: top-k did best with outer_momentum = 0, outer_lr = 1.0" in result.stdout
    assert "this spec has outer_momentum = 0.5, error_feedback_decay = 0.5" in result.stdout  # the default rule's
    tuned = {**topk, "diloco.outer_momentum": 0.0, "diloco.outer_lr": 1.0, "diloco.error_feedback_decay": 0.95}
    assert summary(load_spec(write(tmp_path, mutate(**tuned)(copy.deepcopy(BASE)))))["notes"] == []
    assert summary(load_spec(PLAYBOOKS / "h100-4continents.toml"))["notes"] == []  # int8: nothing to say


def test_spec_check_imports_neither_torch_nor_paramiko_nor_textual():
    import subprocess
    import sys

    code = ("import sys; from typer.testing import CliRunner; from dilococtl.cli import app; "
            f"r = CliRunner().invoke(app, ['spec', 'check', {str(PLAYBOOKS / 'local-2site.toml')!r}]); "
            "assert r.exit_code == 0, r.output; "
            "print(sorted(m for m in ('torch', 'paramiko', 'textual') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("min_sites, mode, noted", [(1, "sync", True), (2, "sync", False), (1, "overlap", True),
                                                    (1, "async", False)])
def test_a_quorum_smaller_than_a_majority_of_three_sites_is_noted(tmp_path, min_sites, mode, noted):
    """3 local sites, min_sites 1, one slowed 6x: it formed a quorum of its own, committed, and ended on another θ."""
    data = copy.deepcopy(BASE)
    data["sites"] = [{"name": f"s{i}", "hosts": [f"10.0.{i}.1"]} for i in range(3)]
    data["diloco"].update(sites=3, min_sites=min_sites, mode=mode)
    notes = summary(load_spec(write(tmp_path, data)))["notes"]
    assert any("min_sites = 1 of 3 sites lets a straggler" in n and "min_sites = 2 keeps one quorum" in n
               for n in notes) == noted, notes
