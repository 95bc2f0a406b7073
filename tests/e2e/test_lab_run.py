"""The whole journey on the emulated WAN, as a user types it: lab up → doctor → provision → launch →
status while it runs → the run finishes → the store holds rounds of all three sites, perplexity falls."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import tomlkit

from tests.e2e.conftest import cli, lab_up

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lab3(tmp_path_factory):
    yield from lab_up(tmp_path_factory, "labrun", "--sites", "3", "--rate", "50mbit", "--rtt", "40ms", runs=("lab-run", "lab-async"))


def test_rehearse_a_three_site_run(lab3):
    home, spec = lab3
    doc = tomlkit.parse(spec.read_text())
    doc["run"]["name"] = "lab-run"
    doc["diloco"]["rounds"] = 8
    spec.write_text(tomlkit.dumps(doc))

    r = cli(home, "doctor", str(spec), "--json")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    report = json.loads(r.stdout)
    assert len(report["nodes"]) == 3

    r = cli(home, "provision", str(spec), "--json")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr

    r = cli(home, "launch", str(spec), "--json")
    assert r.returncode == 0, r.stderr
    run_id = json.loads(r.stdout)["id"]

    seen_running = False
    deadline = time.monotonic() + 300
    while True:
        r = cli(home, "status", run_id, "--json")
        assert r.returncode == 0, r.stderr
        st = json.loads(r.stdout)
        if st["state"] == "running" and any(s["round"] >= 1 for s in st["sites"]):
            seen_running = True
        if st["state"] not in ("launching", "running"):
            break
        assert time.monotonic() < deadline, st
        time.sleep(2)
    assert st["state"] == "finished", cli(home, "logs", run_id).stdout[-3000:]
    assert seen_running
    assert [s["round"] for s in st["sites"]] == [8, 8, 8]
    assert all(s["k_active"] == 3 for s in st["sites"])

    from dilococtl.store import Store

    with Store.open(home / "state.db") as store:
        for site in ("site0", "site1", "site2"):
            rows = store.rounds(run_id, site)
            assert [x.round for x in rows] == list(range(1, 9))
            assert rows[-1].val_ppl < rows[0].val_ppl  # perplexity falls
            assert all(x.bytes_sent > 0 and x.sync_s > 0 for x in rows)
        # the WAN is really in the way: 40 ms between sites, so every exchange takes longer than that
        assert min(x.sync_s for x in store.rounds(run_id)) > 0.04


def test_async_mode_over_tls_on_the_lab(lab3):
    """The outer parameter service on a lab node: keys copied by launch (0600), sites push and pull."""
    home, spec = lab3
    doc = tomlkit.parse(spec.read_text())
    doc["run"]["name"] = "lab-async"
    doc["diloco"]["mode"] = "async"
    doc["diloco"]["rounds"] = 4
    path = home / "async.toml"
    path.write_text(tomlkit.dumps(doc))
    r = cli(home, "launch", str(path), "--wait", "--json", timeout=400)
    assert r.returncode == 0, r.stderr[-2000:]
    st = json.loads(r.stdout)
    assert st["state"] == "finished" and [s["round"] for s in st["sites"]] == [4, 4, 4]
    work = Path(doc["sites"][0]["work_dir"]) / "runs" / st["id"] / "_keys"
    site0 = doc["sites"][0]["name"]
    # the service's keys (it runs beside site 0), the run CA's certificate, site 0's own identity and
    # the run's checkpoint signing key: never the CA's key, never another site's
    assert sorted(p.name for p in work.iterdir()) == sorted(
        ["service.crt", "service.key", "token", "ca.crt", f"{site0}.crt", f"{site0}.key", "checkpoint.key"])
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in work.iterdir())
    from dilococtl.store import Store

    with Store.open(home / "state.db") as store:
        rows = store.rounds(st["id"])
        assert len(rows) == 12 and all(x.bytes_sent > 0 for x in rows)
        assert max(x.staleness for x in rows) >= 1  # three sites pushing at their own pace
