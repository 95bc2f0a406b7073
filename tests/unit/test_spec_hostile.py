"""Run specs as an attacker writes them: every number finite and in range, safe names, hosts and
paths, files that are not files, nesting that blows the parser's stack. Each is one line, exit 2."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import tomlkit
from typer.testing import CliRunner

from dilococtl.cli import app
from dilococtl.errors import EXIT_BAD_INPUT
from dilococtl.spec import load_spec
from dilococtl.spec_checks import NAME_MAX
from dilococtl.spec_types import RunSection, SiteSection, SpecError, SSHSection
from trainer.rules import config as tconfig
from trainer.rules.diloco_config import DilocoConfig
from trainer.rules.model_config import ModelConfig
from trainer.rules.tables import ConfigError

REPO = Path(__file__).resolve().parents[2]
BASE = {
    "run": {"name": "t"},
    "model": {"preset": "tiny"},
    "diloco": {"h": 10, "rounds": 2},
    "sites": [
        {"name": "a", "hosts": ["10.0.0.1"], "work_dir": "/tmp/w"},
        {"name": "b", "hosts": ["10.0.1.1"], "work_dir": "/tmp/w"},
    ],
}
TABLES = {"run": RunSection, "ssh": SSHSection, "model": ModelConfig, "data": tconfig.DataConfig,
          "train": tconfig.TrainConfig, "diloco": DilocoConfig, "checkpoint": tconfig.CheckpointConfig,
          "parallel": tconfig.ParallelConfig, "sites[0]": SiteSection}


def _spec(tmp_path: Path, **changes) -> Path:
    """BASE with "table.key" (or "sites[i].key") set to a value, written as TOML."""
    d = copy.deepcopy(BASE)
    for path, value in changes.items():
        table, key = path.rsplit(".", 1)
        target = d["sites"][int(table[6:-1])] if table.startswith("sites[") else d.setdefault(table, {})
        target[key] = value
    p = tmp_path / "spec.toml"
    p.write_text(tomlkit.dumps(d))
    return p


def _refused(path: Path, expected: str) -> str:
    with pytest.raises(SpecError) as err:
        load_spec(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: {expected}"), msg
    assert msg.isprintable() and "\n" not in msg and len(msg) <= 1000
    assert err.value.exit_code == EXIT_BAD_INPUT
    return msg


def _float_knobs() -> list[str]:
    out = []
    for table, cls in TABLES.items():
        hints = typing.get_type_hints(cls)
        out += [f"{table}.{f.name}" for f in dataclasses.fields(cls)
                if hints[f.name] is float or (float in typing.get_args(hints[f.name])  # float | None too
                                              and typing.get_origin(hints[f.name]) is not dict)]
    return out


def test_the_base_spec_is_valid(tmp_path):
    assert load_spec(_spec(tmp_path)).run.name == "t"


@pytest.mark.parametrize("knob", _float_knobs())
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_every_float_knob_must_be_finite(tmp_path, knob, value):
    _refused(_spec(tmp_path, **{knob: value}), f"{knob}: must be a finite number, got {value}")


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 1e300, -1.0])
def test_every_link_pace_must_be_a_finite_rate(tmp_path, value):
    knob = "diloco.transport_link_pace_mbit"
    _refused(_spec(tmp_path, **{knob: {"a->b": value}}), f"{knob}.'a->b': must be a finite number in [0, 1e7]")
    _refused(_spec(tmp_path, **{knob: value}), f"{knob}: expected a table of numbers")


@pytest.mark.parametrize("value, expected", [("1.0", ""), ('"fast"', ": expected a table")])
def test_a_huge_link_pace_table_is_refused_in_one_short_line(tmp_path, value, expected):
    knob = "diloco.transport_link_pace_mbit"
    p = _spec(tmp_path)  # the table appended as text: tomlkit takes minutes to write 20,000 keys
    rows = "".join(f'"a->b{i}" = {value}\n' for i in range(20_000))
    p.write_text(p.read_text() + f"\n[{knob}]\n{rows}")
    _refused(p, knob + expected)


OUT_OF_RANGE = [
    ("run.grace_s", 1e300, "run.grace_s: must be in [0, 86400] seconds"),
    ("run.grace_s", -1.0, "run.grace_s: must be in [0, 86400] seconds"),
    ("run.join_timeout_ms", 10**15, "run.join_timeout_ms: must be in (0, 86400000]"),
    ("ssh.connect_timeout_s", 1e12, "ssh.connect_timeout_s: must be in (0, 86400] seconds"),
    ("ssh.connect_timeout_s", 0.0, "ssh.connect_timeout_s: must be in (0, 86400] seconds"),
    ("ssh.keepalive_s", 1e9, "ssh.keepalive_s: must be in [0, 86400] seconds"),
    ("ssh.parallel", 10**6, "ssh.parallel: must be in [1, 1024]"),
    ("sites[0].nproc_per_node", 10**6, "sites[0].nproc_per_node: must be in [0, 1024]"),
    ("sites[0].gpus_per_node", -1, "sites[0].gpus_per_node: must be in [0, 1024]"),
    ("train.beta1", 2.0, "train.beta1: must be in [0, 1), got 2.0"),
    ("train.beta2", -0.1, "train.beta2: must be in [0, 1)"),
    ("train.weight_decay", -1.0, "train.weight_decay: must be >= 0, got -1.0"),
    ("train.min_lr_ratio", 1.5, "train.min_lr_ratio: must be in [0, 1]"),
    ("train.eval_batches", -1, "train.eval_batches: must be >= 1, got -1"),
    ("train.eval_batches", 0, "train.eval_batches: must be >= 1, got 0"),
    ("train.eval_every", -1, "train.eval_every: must be >= 0"),
    ("train.threads", -2, "train.threads: must be >= 0"),
    ("train.seed", -1, "train.seed: must be >= 0"),
    ("data.seed", -1, "data.seed: must be >= 0"),
    ("data.val_plays", 0, "data.val_plays: must be >= 1"),
    ("model.n_kv_heads", -1, "model.n_kv_heads: must be >= 0"),
    ("model.dim", -64, "model.dim: must be >= 0"),
    ("model.rope_theta", 0.0, "model.rope_theta: must be > 0"),
    ("model.norm_eps", -1e-5, "model.norm_eps: must be > 0"),
    ("diloco.timeout_s", -1.0, "diloco.timeout_s: must be in [0, 86400] seconds"),
    ("diloco.timeout_s", 1e9, "diloco.timeout_s: must be in [0, 86400] seconds"),
    # the exchange timeout is derived from the link: 1e-300 Mbit/s made it overflow
    ("diloco.link_mbit", 1e-300, "diloco.link_mbit: must be in [0.01, 1e6] Mbit/s"),
]


@pytest.mark.parametrize(("knob", "value", "expected"), OUT_OF_RANGE, ids=[f"{k}={v}" for k, v, _ in OUT_OF_RANGE])
def test_numbers_out_of_range_are_refused(tmp_path, knob, value, expected):
    _refused(_spec(tmp_path, **{knob: value}), expected)


BAD_NAMES = ["a\n", "a/b", "a b", "x" * (NAME_MAX + 1), "x" * 300, "", "-a", ".a", "ä", "a\x00", "a;rm", "a\u2028"]


@pytest.mark.parametrize("knob", ["run.name", "sites[0].name"])
@pytest.mark.parametrize("name", BAD_NAMES, ids=[repr(n)[:20] for n in BAD_NAMES])
def test_names_need_a_safe_charset_and_length(tmp_path, knob, name):
    msg = _refused(_spec(tmp_path, **{knob: name}), f"{knob}: ")
    assert "use letters, digits" in msg or "control characters are not allowed" in msg, msg


def test_a_name_of_the_longest_length_is_accepted(tmp_path):
    spec = load_spec(_spec(tmp_path, **{"run.name": "r" * NAME_MAX, "sites[0].name": "S.1_-" + "s" * (NAME_MAX - 5)}))
    assert len(spec.run.name) == NAME_MAX and len(spec.sites[0].name) == NAME_MAX


@pytest.mark.parametrize("host", ["h;rm -rf /", "$(id)", "`id`", "h\n", "a b", "h" * 254, "h'x", "h>f"])
def test_hosts_cannot_carry_shell_text(tmp_path, host):
    _refused(_spec(tmp_path, **{"sites[0].hosts": [host]}), "sites[0].hosts[0]: ")


def test_lighthouse_host_is_checked_like_a_host(tmp_path):
    _refused(_spec(tmp_path, **{"run.lighthouse": "10.0.0.1;reboot"}), "run.lighthouse: not a host name or address")


@pytest.mark.parametrize("host", ["10.0.0.9", "node-1.dc.example", "fe80::1%eth0", "2001:db8::1"])
def test_ordinary_hosts_are_accepted(tmp_path, host):
    assert load_spec(_spec(tmp_path, **{"sites[0].hosts": [host]})).sites[0].hosts == [host]


@pytest.mark.parametrize(("work_dir", "expected"), [
    ("/tmp/a\nb", "control characters are not allowed"),
    ("/tmp/a\x00b", "control characters are not allowed"),
    ("/tmp/" + "x" * 256, "too long"),
    ("/" + "/x" * 600, "too long"),
])
def test_node_paths_are_bounded_and_printable(tmp_path, work_dir, expected):
    _refused(_spec(tmp_path, **{"sites[1].work_dir": work_dir}), f"sites[1].work_dir: {expected}")


def test_a_work_dir_with_a_space_is_accepted(tmp_path):
    # accepted: every remote command quotes it (tests/unit/test_run_paths_quoted.py)
    assert load_spec(_spec(tmp_path, **{"sites[0].work_dir": "/tmp/my runs"})).sites[0].work_dir == "/tmp/my runs"


def test_an_escape_sequence_in_a_key_does_not_reach_the_terminal(tmp_path):
    p = tmp_path / "spec.toml"
    p.write_text('[run]\nname = "t"\n"\\u001b[2J\\u001b[31mred" = 1\n')
    msg = _refused(p, "run.")
    assert "\x1b" not in msg and "\\x1b[2J" in msg


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dilococtl", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_a_fifo_spec_is_refused_without_waiting(tmp_path):
    fifo = tmp_path / "spec.toml"
    os.mkfifo(fifo)
    r = _cli("spec", "check", str(fifo), timeout=60)  # before: blocked in open() until killed
    assert r.returncode == 2, r.stderr
    assert r.stderr == f"error: {fifo}: not a regular file; a run spec is a TOML file\n"


@pytest.mark.parametrize(("path", "expected"), [
    ("dir", "a directory; a run spec is a TOML file"),
    ("/dev/zero", "not a regular file; a run spec is a TOML file"),
    ("big", "larger than 1048576 bytes"),
    ("binary", "cannot read: not UTF-8 text"),
])
def test_what_is_not_a_small_text_file_is_refused(tmp_path, path, expected):
    if path == "dir":
        p = tmp_path / "d.toml"
        p.mkdir()
    elif path == "big":
        p = tmp_path / "big.toml"
        p.write_text('[run]\nname = "t"\n' + "# " + "x" * (1 << 20) + "\n")
    elif path == "binary":
        p = tmp_path / "bin.toml"
        p.write_bytes(b'[run]\nname = "\xff\xfe"\n')
    else:
        p = Path(path)
    _refused(p, expected)


@pytest.mark.parametrize("nested", ["x = " + "[" * 5000 + "]" * 5000, "x = " + "{a = " * 5000 + "1" + "}" * 5000],
                         ids=["arrays", "inline-tables"])
def test_deeply_nested_toml_is_one_line(tmp_path, nested):
    p = tmp_path / "spec.toml"
    p.write_text(f'[run]\nname = "t"\n{nested}\n')
    _refused(p, "invalid TOML: arrays or tables nested too deeply")
    r = CliRunner().invoke(app, ["spec", "check", str(p)])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "RecursionError" not in r.stderr, r.stderr


def test_a_300_character_site_name_is_refused_before_launch_records_anything(tmp_path):
    # before: spec check passed, launch failed with an OSError and the run stayed in `launching`
    p = tmp_path / "spec.toml"
    p.write_text(f'[run]\nname = "long"\n[[sites]]\nname = "{"s" * 300}"\nhosts = ["local"]\n'
                 f'work_dir = "{tmp_path}"\n')
    for args in (["spec", "check", str(p)], ["launch", str(p)]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 2, r.output
        assert r.stderr.startswith(f"error: {p}: sites[0].name: use letters, digits") and r.stderr.count("\n") == 1
    from dilococtl import paths

    assert not (paths.home() / "state.db").exists()  # nothing recorded


def test_the_trainer_refuses_the_same_values_on_its_own(tmp_path):
    # the trainer's loader checks too (a config written by hand, not by launch)
    p = tmp_path / "cfg.toml"
    p.write_text("[train]\nlr = inf\n")
    with pytest.raises(ConfigError, match=r"train.lr: must be a finite number, got inf"):
        tconfig.load(p)
    p.write_text("[run]\nstartup_wait_s = 1e12\n")
    with pytest.raises(ConfigError, match=r"run.startup_wait_s: must be in \[0, 86400\] seconds"):
        tconfig.load(p)


SHAPES = [(dim, heads, kv) for dim in (48, 64, 96, 100, 102, 66) for heads in (1, 2, 3, 4, 6) for kv in (1, 2, 3)]


@pytest.mark.parametrize(("dim", "heads", "kv"), SHAPES, ids=[f"{d}/{h}/{k}" for d, h, k in SHAPES])
def test_every_model_shape_spec_check_accepts_is_one_the_trainer_can_build(tmp_path, dim, heads, kv):
    # a20f7d3: dim 100 with 4 heads (head dimension 25, odd) passed spec check and failed in rotary
    import torch

    from trainer.model import Transformer
    from trainer.rules.model_config import ModelConfig, resolve_model

    path = _spec(tmp_path, **{"model.dim": dim, "model.n_heads": heads, "model.n_kv_heads": kv, "model.n_layers": 1})
    try:
        load_spec(path)
    except SpecError as e:
        msg = str(e)
        assert "\n" not in msg and msg.startswith(f"{path}: model."), msg
        return
    m = resolve_model(ModelConfig(preset="tiny", dim=dim, n_heads=heads, n_kv_heads=kv, n_layers=1))
    logits = Transformer(m)(torch.zeros(1, 8, dtype=torch.long))
    assert logits.shape == (1, 8, m.vocab_size)
