"""tune-h checks itself: a lab run launched with the tuned H keeps the sync share under the budget,
within 3 points of what tune-h predicted."""

from __future__ import annotations

import json

import pytest
import tomlkit

from dilococtl.runs import sync_share
from dilococtl.store import Store
from tests.e2e.conftest import cli, lab_up

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
BUDGET = 0.10


@pytest.fixture(scope="module")
def lab2(tmp_path_factory):
    yield from lab_up(tmp_path_factory, "labtune", "--sites", "2", "--rate", "20mbit", "--rtt", "40ms", runs=("lab-tune",))


def test_a_run_with_the_tuned_h_keeps_sync_under_the_budget(lab2):
    home, spec = lab2
    doc = tomlkit.parse(spec.read_text())
    doc["run"]["name"] = "lab-tune"
    doc["diloco"]["rounds"] = 5
    doc["train"]["eval_every"] = 0  # evaluation is neither compute nor sync: keep it out of the rounds
    spec.write_text(tomlkit.dumps(doc))

    r = cli(home, "tune-h", str(spec), "--budget", str(BUDGET), "--write", "--duration", "3", "--json",
            timeout=300)
    assert r.returncode == 0, r.stderr
    tuned = json.loads(r.stdout)
    h = tomlkit.parse(spec.read_text())["diloco"]["h"]
    assert h == tuned["h"] and h % 10 == 0 and h > 5

    r = cli(home, "launch", str(spec), "--wait", "--json", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout)
    assert summary["state"] == "finished" and summary["h"] == h
    measured, predicted = summary["sync_share"], summary["predicted_sync_share"]
    assert measured is not None and predicted is not None and predicted <= BUDGET
    # tune-h predicts a steady round; the first exchange also opens the sites' connections (and
    # leaves TCP slow start behind), so the check compares the rounds after it
    with Store.open(home / "state.db") as store:
        rows = store.rounds(summary["id"])
    steady = sync_share([x for x in rows if x.round > 1])
    # within 3 points of the prediction; the share itself may land up to 2 points over the budget on
    # a loaded 2-core box (the prediction sits just under it by construction)
    assert abs(steady - predicted) <= 0.03, (steady, measured, predicted)
    assert steady <= BUDGET + 0.02, (steady, measured, predicted)
