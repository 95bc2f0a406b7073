"""`dilococtl report`: PNG plots and a Markdown summary of a run; the CLI stays light to import."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from PIL import Image
from typer.testing import CliRunner

from dilococtl import goodput
from dilococtl.cli import app
from dilococtl.report import GOODPUT_FILE, PLOT_FILES, SUMMARY_FILE, write_report
from dilococtl.store import Store
from tests.tui.fixtures import make_run, ppl_at


@pytest.fixture
def store():
    s = Store.open()  # the test's own DILOCOCTL_HOME (tests/conftest.py), as the CLI sees it
    yield s
    s.close()


def test_report_writes_valid_pngs_and_a_summary(store, tmp_path):
    run = make_run(store, state="finished", rounds=10)
    files = write_report(store, run.id, tmp_path / "out")
    assert [f.name for f in files] == [*PLOT_FILES, GOODPUT_FILE, SUMMARY_FILE]
    for f in files[:4]:
        with Image.open(f) as im:
            im.verify()  # a complete, uncorrupted PNG
        with Image.open(f) as im:
            assert im.format == "PNG" and im.size == (880, 495)  # 8 x 4.5 in at 110 dpi
            colors = im.convert("RGB").getcolors(1 << 20)
            assert len(colors) > 20  # curves and text, not a blank canvas
    md = (tmp_path / "out" / SUMMARY_FILE).read_text()
    assert f"# Run local-2site ({run.id})" in md and "- state: **finished**" in md
    assert f"{ppl_at(1):.3f} at the start, {ppl_at(10):.3f} at the end" in md
    # the columns of status and watch, by the same names (dilococtl/columns.py)
    assert "| site | state | round | step | K | eff | stale | sync s | WAN | tok/s | MFU | loss | val ppl | MB sent |" in md
    assert "| site-a | finished | 10 | 200 | 2/2 | 87.5% | 0 | 1.50 | 666.67kB/s | 40.00k |" in md
    # the sites' sync seconds over their round seconds, summed over the records: (1.5 + 2.5) / (2 x 12) s
    assert ("sync share of round time (compute + sync): 16.7% (40.0 s of 240.0 s, summed over the sites' rounds; "
            "10 rounds)") in md
    assert "- checkpoint: 10" in md and "![perplexity_vs_tokens.png](perplexity_vs_tokens.png)" in md


def test_report_of_a_run_without_rounds_is_a_summary_only(store, tmp_path):
    run = make_run(store, with_data=False)
    files = write_report(store, run.id, tmp_path)
    assert [f.name for f in files] == [SUMMARY_FILE]
    assert "No rounds recorded: nothing to plot." in files[0].read_text()


def test_cli_report_json_prints_the_paths(store, tmp_path):
    run = make_run(store, state="finished", rounds=5)
    res = CliRunner().invoke(app, ["report", run.id, "--out", str(tmp_path / "r"), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["run"] == run.id
    assert out["files"] == [str(tmp_path / "r" / n) for n in (*PLOT_FILES, GOODPUT_FILE, SUMMARY_FILE)]
    assert all((tmp_path / "r" / n).stat().st_size > 1000 for n in PLOT_FILES)
    assert out["goodput"]["rounds"][0]["round"] == 1
    assert out["goodput"]["lost_s"].keys() == set(goodput.CAUSES)


def test_cli_report_default_dir_and_unknown_run(store):
    run = make_run(store, state="finished", rounds=3)
    res = CliRunner().invoke(app, ["report", "local-2site"])
    assert res.exit_code == 0, res.output
    from dilococtl.paths import runs_dir

    assert (runs_dir() / run.id / "report" / SUMMARY_FILE).exists()
    res = subprocess.run([sys.executable, "-m", "dilococtl", "report", "no-such-run"], capture_output=True, text=True)
    assert res.returncode == 2 and "no run with id or name 'no-such-run'" in res.stderr


def test_watch_of_an_unknown_run_is_a_one_line_error():
    res = subprocess.run([sys.executable, "-m", "dilococtl", "watch", "nope"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and res.stderr.strip() == (
        "error: no run 'nope': no runs recorded yet (start one with `dilococtl launch SPEC`)")


def test_help_does_not_import_textual_or_matplotlib():
    code = ("import sys; from dilococtl.cli import app; from typer.testing import CliRunner; "
            "r = CliRunner().invoke(app, ['--help']); assert 'watch' in r.output and 'report' in r.output; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('textual', 'matplotlib', 'plotext')))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_perplexity_plot_is_log_scaled_on_one_token_axis_with_the_final_value(store):
    """Issue 42 case 4: sites with equal perplexities are one curve on the tokens of all sites, the
    axis is logarithmic so the second half still reads, and the final value is written on the plot."""
    from dilococtl import queries
    from dilococtl.report import perplexity_figure

    run = make_run(store, state="finished", rounds=10)
    series = queries.series(store, run.id)
    ax = perplexity_figure(series, title="t").axes[0]
    assert ax.get_yscale() == "log" and ax.get_xlabel() == "tokens (all sites)"
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert set(lines) == {"site-a", "site-b", "global"}
    xs = {k: list(ln.get_xdata()) for k, ln in lines.items()}
    assert xs["site-a"] == xs["site-b"] == xs["global"] == [2 * 20 * 1024 * r for r in range(1, 11)]
    assert [t.get_text() for t in ax.texts] == [f"{ppl_at(10):.2f}"]
    assert ax.texts[0].xy == (xs["global"][-1], pytest.approx(ppl_at(10)))


def test_efficiency_plot_shows_the_summarys_whole_run_figure(store, tmp_path):
    """Issue 42: the summary said 96-97% and the plot dipped to 86% with nothing to say why the two
    differ; each site's whole-run efficiency (the summary's eff cell) is now a labelled line on it."""
    run = make_run(store, state="finished", rounds=10)
    write_report(store, run.id, tmp_path / "out")
    md = (tmp_path / "out" / SUMMARY_FILE).read_text()
    assert "| site-a | finished | 10 | 200 | 2/2 | 87.5% |" in md and "| 79.2% |" in md
    from dilococtl import queries
    from dilococtl.report import round_figure

    ax = round_figure(queries.series(store, run.id), "efficiency", title="t").axes[0]
    labels = ax.get_legend_handles_labels()[1]
    assert labels == ["site-a", "site-a whole run 87.5%", "site-b", "site-b whole run 79.2%"]
