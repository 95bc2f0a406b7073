"""`dilococtl report`'s lost time by cause per round (issue 36): the plot's bars are the goodput ledger's
rounds, goodput.json holds the same figures, and lying records draw and write finite figures."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from dilococtl import goodput
from dilococtl.report import (
    CAUSE_COLORS,
    GOODPUT_FILE,
    LOST_BARS,
    PLOT_FILES,
    SUMMARY_FILE,
    lost_figure,
    report_json,
    write_report,
)
from dilococtl.store import Store
from tests.unit.test_goodput_rounds import _round, _run


@pytest.fixture
def store():
    with Store.open() as s:
        yield s


def _bars(ax) -> dict[str, list[tuple[float, float]]]:
    """cause -> [(x centre, height)] of its bars"""
    out: dict[str, list[tuple[float, float]]] = {}
    for c in ax.containers:
        out[c.get_label().split()[0]] = [(p.get_x() + p.get_width() / 2, p.get_height()) for p in c.patches]
    return out


def test_report_plots_and_writes_lost_time_by_cause_per_round(store, tmp_path):
    run = _run(store, tmp_path)  # a stall in round 3, round 4 rolled back, a relaunch in round 5
    files = write_report(store, run.id, tmp_path / "out")
    assert [f.name for f in files] == [*PLOT_FILES, GOODPUT_FILE, SUMMARY_FILE]
    png = tmp_path / "out" / "lost_time_per_round.png"
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size == (880, 495) and len(im.convert("RGB").getcolors(1 << 20)) > 20
    data = json.loads((tmp_path / "out" / GOODPUT_FILE).read_text())
    assert data["goodput"] == pytest.approx(88 / 250) and data["bucket_rounds"] == 1
    assert data["useful_s"] == pytest.approx(88) and data["wall_s"] == pytest.approx(250)
    per = {r["round"]: r["lost_s"] for r in data["rounds"]}
    assert [per[r]["failure_detection"] for r in range(1, 7)] == pytest.approx([0, 0, 32, 0, 0, 0])
    assert [per[r]["discarded"] for r in range(1, 7)] == pytest.approx([0, 0, 0, 8, 0, 0])
    assert [per[r]["restart"] for r in range(1, 7)] == pytest.approx([0, 0, 0, 0, 30, 0])
    assert [per[r]["exchange"] for r in range(1, 7)] == pytest.approx([3, 3, 1.5, 3, 3, 3])
    assert [per[r]["other"] for r in range(1, 7)] == pytest.approx([0, 0, 0, 0, 0, 70])
    for cause in goodput.CAUSES:  # the rounds add up to the run's lost seconds (status's figures)
        assert sum(p[cause] for p in per.values()) == pytest.approx(data["lost_s"][cause])
    assert data["lost_s"] == pytest.approx(goodput.ledger(run, store).lost_s)
    assert report_json(files) == {"goodput": data}
    md = (tmp_path / "out" / SUMMARY_FILE).read_text()
    assert "![lost_time_per_round.png](lost_time_per_round.png)" in md and "## Goodput" in md
    assert "35.2% of the sites' wall time reached θ (88.0 s of 250.0 s)" in md
    assert "| 16.5 | 5.5 | 32.0 | 30.0 | 8.0 | 70.0 |" in md

    # the figure's bars are those figures, stacked in CAUSES order, one colour per cause
    ax = lost_figure(goodput.ledger(run, store, bucket=1), title="t").axes[0]
    assert ax.get_title() == "t: lost time by cause per round, goodput 35.2%"
    bars = _bars(ax)
    assert list(bars) == ["exchange", "straggler", "failure_detection", "restart", "discarded", "other"]
    for cause, xs in bars.items():
        assert xs == [(float(r), pytest.approx(per[r][cause])) for r in range(1, 7)]
    labels = ax.get_legend_handles_labels()[1]
    assert labels[2] == "failure_detection 32.0 s" and labels[3] == "restart 30.0 s"
    fd = next(c for c in ax.containers if c.get_label().startswith("failure_detection"))
    from matplotlib.colors import to_rgba

    assert fd.patches[0].get_facecolor() == to_rgba(CAUSE_COLORS["failure_detection"])
    assert fd.patches[2].get_y() == pytest.approx(2.0)  # on round 3's exchange (1.5) and straggler (0.5)


def test_a_long_run_is_summed_into_at_most_lost_bars_bars(store, tmp_path):
    run = _run(store, tmp_path)
    t0 = run.created
    store.ingest(run.id, "a", "h", "/m", 2, [_round(r, t0 + 60 + 0.01 * r) for r in range(7, 251)])
    files = write_report(store, run.id, tmp_path / "out")
    data = json.loads(next(f for f in files if f.name == GOODPUT_FILE).read_text())
    assert data["bucket_rounds"] == 3 and len(data["rounds"]) <= LOST_BARS  # 250 rounds in bars of 3
    assert [r["round"] for r in data["rounds"][:3]] == [1, 4, 7]
    assert data["rounds"][0]["lost_s"]["failure_detection"] == pytest.approx(32)  # round 3 is in the first bar
    ax = lost_figure(goodput.ledger(store.get_run(run.id), store, bucket=3), title="t").axes[0]
    assert ax.get_xlabel() == "outer round (sums of 3 rounds)"
    assert _bars(ax)["exchange"][0][0] == pytest.approx(2.0)  # the middle of rounds 1-3


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "-1e9", "1e308"])
def test_lying_seconds_draw_a_plot_and_write_strict_json(store, tmp_path, value):
    run = _run(store, tmp_path)
    obj = json.loads(_round(3, run.created + 30))
    for k in ("compute_s", "sync_s", "quorum_s"):
        obj[k] = "__lie__"
    store.ingest(run.id, "a", "h", "/m", 2, [json.dumps(obj).replace('"__lie__"', value)])
    files = write_report(store, run.id, tmp_path / "out")

    def no_constant(name):
        raise AssertionError(f"{name} in goodput.json")

    data = json.loads((tmp_path / "out" / GOODPUT_FILE).read_text(), parse_constant=no_constant)
    values = [v for r in data["rounds"] for v in (r["useful_s"], *r["lost_s"].values())]
    assert all(v >= 0 for v in values) and 0 <= data["goodput"] <= 1
    for cause in goodput.CAUSES:
        assert sum(r["lost_s"][cause] for r in data["rounds"]) == pytest.approx(data["lost_s"][cause])
    with Image.open(next(f for f in files if f.name == "lost_time_per_round.png")) as im:
        im.verify()
