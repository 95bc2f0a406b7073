"""The sparse codec's quality bound on H: tune-h stops there, says what it costs in sync mode, and spec
check notes a spec past it. (A lab run at tune-h's H = 2770 ended at val ppl 252: BENCHMARKS.md.)"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from dilococtl.cli import app
from dilococtl.spec import load_spec
from dilococtl.spec_summary import notes
from dilococtl.tune import tune_h as tune_cmd
from dilococtl.tune.choose import choose, net_of, plan
from dilococtl.tune.measure import Link
from tests.unit.test_tune import SPEC as TWO_SITES
from trainer.rules.codec_spec import SPARSE_MAX_H, codec_max_h

# a slow link (10 Mbit/s, 100 ms) and a fast step: every codec's sync-sized H is in the thousands
LINKS = [Link(src=a, dst=b, src_host="local", dst_host="local", mbit=10, rtt_ms=100) for a, b in (("a", "b"), ("b", "a"))]
STEPS = {"source": "bench", "per_site": {"a": 0.01, "b": 0.01}}  # the lab's tiny step


def _spec(tmp_path, codec="sparseloco", mode="sync", h=20, extra=""):
    p = tmp_path / "spec.toml"
    text = TWO_SITES.replace('compression = "none"', f'compression = "{codec}"\nmode = "{mode}"\n{extra}')
    p.write_text(text.replace("h = 5  # inner steps per round", f"h = {h}").format(root=tmp_path))
    return p


def test_only_the_sparse_codec_is_bounded():
    assert codec_max_h("sparse:0.0175") == codec_max_h("sparse:0.01+int8") == SPARSE_MAX_H
    assert codec_max_h("none") is None and codec_max_h("int8") is None and codec_max_h("topk:0.01+int8") is None


def test_choose_stops_at_the_cap_and_says_whether_the_budget_holds():
    kw = dict(sites=["a", "b"], net=net_of(LINKS), step_by_site={"a": 0.01, "b": 0.01},
              ph=[("sum", 100_000)], lighthouse_site="a", budget=0.03, max_h=100_000)
    free = choose(mode="sync", **kw)
    assert free.h > 100 and free.codec_cap is None and free.within_max
    sync = choose(mode="sync", h_cap=100, **kw)
    assert (sync.h, sync.codec_cap, sync.within_max) == (100, 100, False)
    assert sync.efficiency < 1 / 1.03 and sync.sync_s == free.sync_s
    # overlap hides the exchange behind the next round at the same H: the budget holds there
    over = choose(mode="overlap", land=None, h_cap=100, **kw)
    assert (over.h, over.codec_cap, over.within_max, over.efficiency) == (100, 100, True, 1.0)
    assert over.land * 100 * 0.01 >= over.sync_s
    # async: each site's push hides behind its next round too
    asy = choose(mode="async", land=None, h_cap=100, **kw)
    assert (asy.h, asy.codec_cap, asy.within_max) == (100, 100, True) and choose(mode="async", land=None, **kw).h > 100
    # a cap above what the budget needs changes nothing
    assert choose(mode="sync", h_cap=free.h + 10, **kw) == free


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_tune_h_of_a_sparseloco_spec_on_a_slow_link(tmp_path, monkeypatch, mode):
    p = _spec(tmp_path, mode=mode)
    planned = plan(load_spec(p), LINKS, STEPS, budget=0.03)
    assert planned.choice.h == SPARSE_MAX_H and planned.choice.codec_cap == SPARSE_MAX_H
    fp32 = plan(load_spec(_spec(tmp_path, codec="none", mode=mode)), LINKS, STEPS, budget=0.03)
    assert fp32.choice.h > 1000 and fp32.choice.codec_cap is None
    monkeypatch.setattr(tune_cmd, "tune", lambda *a, **k: planned)
    r = CliRunner().invoke(app, ["tune-h", str(p), "--budget", "0.03"])
    if mode == "sync":
        assert r.exit_code == 1, r.output
        (line,) = [x for x in r.stderr.splitlines() if x.startswith("error:")]
        assert f"cannot be met at H <= {SPARSE_MAX_H}, the most sparse:0.0175 keeps its quality at" in line
        assert 'set diloco.mode = "overlap"' in line
    else:
        assert r.exit_code == 0, r.output
        assert f"H = {SPARSE_MAX_H}: predicted efficiency 100.0%" in r.stdout
        assert f"note: H stops at {SPARSE_MAX_H}" in r.stdout


@pytest.mark.parametrize(("h", "extra", "noted"), [
    (100, "", False), (2770, "", True), (20, 'h_min = 10\nh_max = 1000\nh_auto = true', True),
    (20, 'h_min = 10\nh_max = 100\nh_auto = true', False)])
def test_spec_check_notes_a_sparse_h_past_the_bound(tmp_path, h, extra, noted):
    got = [n for n in notes(load_spec(_spec(tmp_path, h=h, extra=extra))) if "keeps its quality" in n]
    assert bool(got) == noted, got
    if noted:
        assert ("h_max = 1000" if "h_auto" in extra else f"h = {h}") in got[0]
    assert not [n for n in notes(load_spec(_spec(tmp_path, codec="int8", h=2770))) if "keeps its quality" in n]
