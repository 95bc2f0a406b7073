"""A real recorded run with every sink on: each sink, read back by its own library, equals status --json.

One local 2-site run of the tiny trainer (tests/integration/test_cli_runs.py's spec), with
`metrics serve` scraped while the run is live and while `watch --json` is open on it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dilococtl.store import Store
from tests import sink_readers
from tests.integration.test_cli_runs import ROOT, cli, write_spec

pytestmark = pytest.mark.slow
ROUNDS = 25  # the demo's rounds: the run is scraped mid-way while it is live
SINKS = '\n[metrics]\nsinks = ["tensorboard", "wandb", "mlflow"]\n'


def _popen(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dilococtl", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ), stdin=subprocess.DEVNULL)


def _scrape(url: str) -> dict:
    text = httpx.get(url, timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _stop(p: subprocess.Popen) -> None:
    p.terminate()
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def test_every_sink_of_a_real_run_equals_status(tmp_path):
    spec = write_spec(tmp_path, name="sinks", rounds=ROUNDS)
    spec.write_text(spec.read_text() + SINKS)
    serve = _popen("metrics", "serve", "--port", "0", "--json", "--no-collect")
    launch = watch = None
    seen: list[tuple[str, float]] = []  # (state, newest round of site-a) of the run, per scrape while launch runs
    try:
        url = json.loads(serve.stdout.readline())["url"]
        launch = _popen("launch", str(spec), "--wait", "--json")
        live = None
        deadline = time.monotonic() + 300
        while launch.poll() is None and time.monotonic() < deadline:
            got = _scrape(url)  # launch --wait collects into the store; the exporter reads it live
            runs = [dict(k[1]) for k in got if k[0] == "dilococtl_run_info"]
            if runs and live is None:
                live = runs[0]["run"]  # recorded, still launching: watch opens on it at once
                watch = _popen("watch", live, "--json", "--interval", "1")  # collects too: two writers
                assert json.loads(watch.stdout.readline())["id"] == live
                continue
            if live is not None:
                seen += [(r["state"], got.get(("dilococtl_round", (("run", live), ("site", "site-a"))), 0))
                         for r in runs if r["run"] == live]
            time.sleep(0.3)
        out, err = launch.communicate(timeout=300)
        assert launch.returncode == 0, err[-3000:]
        assert watch is not None and watch.wait(timeout=60) == 0  # watch followed the run to its end
    finally:
        for p in (watch, launch, serve):
            if p is not None and p.poll() is None:
                _stop(p)
    # served while the run was live, with watch open on it, rounds rising as they were recorded
    assert any(state == "running" and 1 <= r < ROUNDS for state, r in seen), sorted(set(seen))
    status = json.loads(cli("status", live, "--json").stdout)
    assert status["state"] == "finished"
    with Store.open() as store:
        rows = store.rounds(live)
        errors = [e.message for e in store.events(live, kinds=["error"])]
    assert not errors
    tb, texts = sink_readers.tensorboard_series(live)
    wb, wb_texts = sink_readers.wandb_series(live)
    keys = [f"val_ppl/{s['site']}" for s in status["sites"]]
    ml = sink_readers.mlflow_series(live, keys)
    for s in status["sites"]:
        want = [r.val_ppl for r in rows if r.site == s["site"]]
        assert len(want) == ROUNDS and abs(want[-1] - s["val_ppl"]) <= 1e-6
        for name, got in (("tensorboard", tb), ("wandb", wb), ("mlflow", ml)):
            pts = got[f"val_ppl/{s['site']}"]
            assert len(pts) == ROUNDS, name
            assert max(abs(v - w) for (_, v), w in zip(pts, want, strict=True)) <= 1e-6, name
            assert abs(pts[-1][1] - s["val_ppl"]) <= 1e-6, name
            xs = [x for x, _ in pts]
            assert xs == sorted(xs) and xs[-1] == sum(t.tokens for t in rows if t.round == ROUNDS), name
    assert any(": start: " in t for t in texts) and sorted(texts) == sorted(wb_texts)
