"""`dilococtl metrics serve`: a real exporter process, scraped over HTTP, parsed by prometheus_client."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dilococtl.store import Store
from tests.tui.fixtures import make_run

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dilococtl", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=dict(os.environ), stdin=subprocess.DEVNULL)


def _scrape(*args: str) -> dict:
    p = subprocess.Popen([sys.executable, "-m", "dilococtl", "metrics", "serve", "--port", "0", "--json",
                          "--no-collect", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=dict(os.environ), stdin=subprocess.DEVNULL)
    try:
        url = json.loads(p.stdout.readline())["url"]
        text = httpx.get(url, timeout=30).text
    finally:
        p.terminate()
        p.wait(timeout=30)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.mark.slow  # ~3 s: three CLI processes
def test_a_scrape_shows_what_status_shows_under_prometheus_names():
    with Store.open() as store:
        live = make_run(store, state="running", rounds=6)
        ended = make_run(store, run_id="20260101-000000-ffff", state="finished", rounds=3)
    status = json.loads(_cli("status", live.id, "--json", "--no-refresh").stdout)
    got = _scrape()
    for s in status["sites"]:
        labels = (("run", live.id), ("site", s["site"]))
        assert abs(got[("dilococtl_val_perplexity", labels)] - s["val_ppl"]) <= 1e-6
        assert got[("dilococtl_sent_bytes_total", labels)] == s["bytes_sent"]
        assert got[("dilococtl_last_sync_seconds", labels)] == s["last_sync_s"]
        assert abs(got[("dilococtl_compute_efficiency_ratio", labels)] - s["efficiency"]) <= 1e-12
    assert got[("dilococtl_run_info", (("name", "local-2site"), ("run", live.id), ("state", "running")))] == 1
    assert not any(dict(k[1]).get("run") == ended.id for k in got)  # a finished run is not live...
    assert any(dict(k[1]).get("run") == ended.id for k in _scrape("--run", ended.id))  # ...unless asked for
    names = {k[0] for k in got}
    assert all(n.startswith("dilococtl_") for n in names)
    assert {n for n in names if "bytes" in n} == {"dilococtl_sent_bytes_total", "dilococtl_received_bytes_total"}
    assert {n for n in names if "sync" in n and "share" not in n} == {"dilococtl_last_sync_seconds"}


def test_a_busy_port_is_one_line_and_exit_2():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _cli("metrics", "serve", "--port", str(port), "--no-collect")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: cannot listen on 127.0.0.1:{port}:")


def test_the_grafana_dashboard_asks_only_for_names_the_exporter_serves():
    import re

    from dilococtl.sinks.prometheus import PREFIX, SITE_FAMILIES

    served = {PREFIX + f.name + ("_total" if f.kind == "counter" else "") for f in SITE_FAMILIES}
    served |= {PREFIX + n for n in ("run_info", "sync_share_ratio", "rounds_planned", "events_total",
                                    "event_timestamp_seconds")}
    dash = json.loads((ROOT / "playbooks" / "grafana" / "dilococtl.json").read_text())
    asked = {name for p in dash["panels"] for t in p["targets"] for name in re.findall(r"dilococtl_[a-z_]+", t["expr"])}
    asked |= {name for a in dash["annotations"]["list"] for name in re.findall(r"dilococtl_[a-z_]+", a.get("expr", ""))}
    asked |= set(re.findall(r"dilococtl_[a-z_]+", json.dumps(dash["templating"])))
    assert asked and asked <= served, asked - served
    titles = {p["title"] for p in dash["panels"]}  # what watch shows
    assert {"Validation perplexity", "Compute efficiency (compute / (compute + sync))", "Last sync", "Staleness",
            "K active / K nominal", "Sync share of round time"} <= titles


def test_events_are_served_for_grafana_annotations_at_their_own_time():
    """Issue 39: the run's events as annotations. Grafana's Prometheus annotation with "series value as
    timestamp" puts each series' value (ms) on the time axis: one series per event, its value its time."""
    from prometheus_client.core import CollectorRegistry
    from prometheus_client.exposition import generate_latest

    from dilococtl.paths import db_path
    from dilococtl.sinks.prometheus import ANNOTATED_EVENTS, StoreCollector

    with Store.open() as store:
        run = make_run(store, state="running", rounds=6)
        store.add_event(run.id, "quorum", "K_active 1 of 2: site-b left the quorum " + "x" * 300, site="site-a",
                        t=1_767_225_700.25)
        want = [(e.id, e.site, e.event, e.t) for e in store.events(run.id) if e.event != "checkpoint"]
        checkpoints = [e for e in store.events(run.id) if e.event == "checkpoint"]
    assert want and checkpoints  # the fixture records both kinds
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(db_path()))
    text = generate_latest(registry).decode()
    marks = [s for fam in text_string_to_metric_families(text) if fam.name == "dilococtl_event_timestamp_seconds"
             for s in fam.samples]
    got = sorted((int(s.labels["id"]), s.labels["site"], s.labels["event"], s.value) for s in marks)
    assert got == sorted(want)  # every non-routine event at its own time (to the float), checkpoints left out
    assert all(s.labels["run"] == run.id for s in marks)
    quorum = next(s for s in marks if s.labels["event"] == "quorum")
    assert quorum.labels["message"].startswith("K_active 1 of 2") and len(quorum.labels["message"]) == 160

    with Store.open() as store:  # a long run serves only its newest events
        for i in range(ANNOTATED_EVENTS + 10):
            store.add_event(run.id, "heal", f"heal {i}", site="site-b", t=1_767_300_000.0 + i)
    text = generate_latest(registry).decode()
    marks = [s for fam in text_string_to_metric_families(text) if fam.name == "dilococtl_event_timestamp_seconds"
             for s in fam.samples]
    assert len(marks) == ANNOTATED_EVENTS
    assert min(s.value for s in marks) == 1_767_300_010.0 and max(s.value for s in marks) == 1_767_300_059.0

    dash = json.loads((ROOT / "playbooks" / "grafana" / "dilococtl.json").read_text())
    ann = next(a for a in dash["annotations"]["list"] if "dilococtl_event_timestamp_seconds" in a.get("expr", ""))
    assert ann["useValueForTime"] and ann["expr"].endswith("* 1000")  # Grafana's times are milliseconds
    assert ann["datasource"]["uid"] == "${datasource}" and 'run=~"$run"' in ann["expr"]
    assert "{{event}}" in ann["titleFormat"] and "{{message}}" in ann["textFormat"]
