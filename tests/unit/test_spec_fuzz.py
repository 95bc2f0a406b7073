"""Property-based fuzz of run specs: mutate a valid spec (types, ranges, names, nesting, unicode, raw
bytes) and run `spec check` and `launch --dry-run` on it. Every case exits 0 or 2 with one line on
stderr, none shows a traceback, and none writes to the store.

40 examples per test by default (seconds); DILOCOCTL_FUZZ_EXAMPLES=500 for a longer hunt (500 each
passed when this was written)."""

from __future__ import annotations

import copy
import dataclasses
import os
import tempfile
from pathlib import Path

import tomlkit
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from dilococtl import paths
from dilococtl.cli import app
from dilococtl.spec_types import RunSection, SiteSection, SSHSection
from trainer.rules import config as tconfig
from trainer.rules.diloco_config import DilocoConfig
from trainer.rules.model_config import ModelConfig

BASE = {
    "run": {"name": "fuzz", "lighthouse_port": 29510},
    "model": {"preset": "tiny"},
    "data": {"seq_len": 32, "batch_size": 4},
    "train": {"lr": 0.003},
    "diloco": {"h": 5, "rounds": 2, "compression": "int8"},
    "checkpoint": {"every_rounds": 1},
    "ssh": {"connect_timeout_s": 5.0},
    "sites": [
        {"name": "a", "hosts": ["local"], "work_dir": "/tmp/dilococtl-fuzz"},
        {"name": "b", "hosts": ["local"], "work_dir": "/tmp/dilococtl-fuzz"},
    ],
}
TABLES = {"run": RunSection, "ssh": SSHSection, "model": ModelConfig, "data": tconfig.DataConfig,
          "train": tconfig.TrainConfig, "diloco": DilocoConfig, "checkpoint": tconfig.CheckpointConfig,
          "parallel": tconfig.ParallelConfig}
KEYS = [(t, f.name) for t, cls in TABLES.items() for f in dataclasses.fields(cls)]
SITE_KEYS = [f.name for f in dataclasses.fields(SiteSection)]

# values an attacker (or a typo) puts in a spec
scalars = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.sampled_from([0, -1, 1, 2**31, 2**63 - 1, -(2**63)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("inf"), float("-inf"), float("nan"), 1e308, -0.0, 5e-324]),
    st.booleans(),
    st.text(max_size=40),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=250, max_size=320),  # long, any unicode
    st.sampled_from(["a\nb", "a/b", "../..", "a b", "$(id)", "a;reboot", "\x1b[31m", "\x00", "é", "\u202e", ""]),
)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=12)


@st.composite
def mutated_specs(draw) -> dict:
    """BASE with one to four mutations: a key set to a hostile value, deleted, or added."""
    doc = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["table", "site", "unknown", "delete", "sites", "name"]))
        if kind == "table":
            table, key = draw(st.sampled_from(KEYS))
            doc.setdefault(table, {})[key] = draw(values)
        elif kind == "site":
            sites = [x for x in doc["sites"] if isinstance(x, dict)] if isinstance(doc.get("sites"), list) else []
            if sites:
                draw(st.sampled_from(sites))[draw(st.sampled_from(SITE_KEYS))] = draw(values)
        elif kind == "unknown":
            where = draw(st.sampled_from([doc, *[v for v in doc.values() if isinstance(v, dict)]]))
            where[draw(st.text(min_size=1, max_size=12))] = draw(values)
        elif kind == "delete":
            table = draw(st.sampled_from(sorted(doc)))
            if isinstance(doc[table], dict) and doc[table] and draw(st.booleans()):
                doc[table].pop(draw(st.sampled_from(sorted(doc[table]))))
            else:
                doc.pop(table)
        elif kind == "sites":
            doc["sites"] = draw(st.one_of(values, st.lists(st.fixed_dictionaries(
                {"name": st.text(max_size=70), "hosts": st.lists(st.text(max_size=20), max_size=3)}), max_size=3)))
        else:
            doc.setdefault("run", {})["name"] = draw(st.text(max_size=300))
    return doc


def _toml(doc: dict) -> str | None:
    try:
        return tomlkit.dumps(doc)
    except Exception:  # a value TOML cannot hold (tomlkit refuses it): not a spec anyone can write
        return None


def _check(text: bytes, home: Path) -> None:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "spec.toml"
        p.write_bytes(text)
        for args in (["spec", "check", str(p)], ["launch", str(p), "--dry-run", "--json"]):
            r = CliRunner().invoke(app, args)
            out = f"{args}: exit {r.exit_code}\nstdout: {r.stdout[-500:]}\nstderr: {r.stderr[-1000:]}"
            assert r.exception is None or isinstance(r.exception, SystemExit), (out, repr(r.exception))
            assert r.exit_code in (0, 2), out
            assert "Traceback" not in r.stderr, out
            if r.exit_code == 2:
                assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, out
                assert r.stderr[:-1].isprintable(), out
    assert not paths.db_path(create=False).exists()  # nothing was recorded
    assert not any(home.glob("runs/*")), list(home.iterdir())


FUZZ = settings(max_examples=int(os.environ.get("DILOCOCTL_FUZZ_EXAMPLES", "40")), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@FUZZ
@given(doc=mutated_specs())
def test_mutated_specs_exit_0_or_2_with_one_line(doc):
    text = _toml(doc)
    if text is not None:
        _check(text.encode(), paths.home())


@FUZZ
@given(data=st.data())
def test_spliced_bytes_exit_0_or_2_with_one_line(data):
    # the parser's side: random bytes (invalid UTF-8, NUL, brackets, quotes) spliced into valid TOML
    base = tomlkit.dumps(BASE).encode()
    at = data.draw(st.integers(0, len(base)))
    cut = data.draw(st.integers(0, 20))
    junk = data.draw(st.one_of(st.binary(max_size=30), st.sampled_from([b"[[", b"]]", b'"', b"{", b"=", b"\x00",
                                                                        b"\xff\xfe", b"[" * 2000])))
    _check(base[:at] + junk + base[at + cut:], paths.home())
