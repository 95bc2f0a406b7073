"""The spec `lab up --spec-out` writes is the first a user runs: enough rounds for tune-h, and it says
that tune-h --write chooses its H (the README's rehearsal; the e2e test holds its efficiency)."""

from __future__ import annotations

from dilococtl.lab import model, runspec
from dilococtl.spec import load_spec
from dilococtl.tune.choose import rounds_at
from dilococtl.tune.defaults import FEW_ROUNDS


def test_the_lab_spec_has_the_rounds_tune_h_asks_for_and_names_tune_h(tmp_path, monkeypatch):
    monkeypatch.setenv("DILOCOCTL_HOME", str(tmp_path / "home"))
    st = model.plan(lab_id="ab12", block="10.210.0.0/16", sites=3, nodes_per_site=1, rate_bit=50_000_000,
                    rtt_ms=80.0, links=[], python="/usr/bin/python3")
    path = tmp_path / "lab.toml"
    runspec.write_spec(st, path)
    spec = load_spec(path)
    # whatever H tune-h writes, the run keeps its rounds: no "too few rounds" note on a first run
    assert rounds_at(spec, 650) >= FEW_ROUNDS and spec.diloco.rounds == 10
    assert path.read_text().splitlines()[1] == "# `dilococtl tune-h lab.toml --write` measures the links and writes diloco.h"
