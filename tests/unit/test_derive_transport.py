"""launch's TLS streams and pacing for an untuned spec, derived from the newest stored link measurement
(doctor --links or tune-h) of the same site leaders; a relaunch reuses what the run started with."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import pytest

from dilococtl import derive_transport
from dilococtl.spec import load_spec
from dilococtl.store import Store

SPEC = """
[run]
name = "wan"

[model]
preset = "{preset}"

[diloco]
h = 50
{extra}

[[sites]]
name = "east"
hosts = ["10.9.1.10"]
work_dir = "/tmp/east"

[[sites]]
name = "west"
hosts = ["10.9.2.10"]
work_dir = "/tmp/west"
"""

# a window-limited 50 Mbit/s, 80 ms link: 8 Mbit/s a stream, full at 8 streams (the lab's, measured)
SWEEP = [[1, 8.4], [2, 16.8], [4, 34.1], [8, 47.8], [16, 47.8]]


def _link(src_host: str, dst_host: str, sweep=SWEEP, rtt_ms: float = 81.0, src: str = "a", dst: str = "b") -> dict:
    return {"src": src, "dst": dst, "src_host": src_host, "dst_host": dst_host, "mbit": sweep[-1][1],
            "rtt_ms": rtt_ms, "streams": sweep[-1][0], "stream_mbit": sweep[0][1], "sweep": sweep}


BOTH = [_link("10.9.1.10", "10.9.2.10"), _link("10.9.2.10", "10.9.1.10", src="b", dst="a")]


def _spec(tmp_path: Path, preset: str = "tiny", extra: str = ""):
    p = tmp_path / "spec.toml"
    p.write_text(SPEC.format(preset=preset, extra=extra))
    return load_spec(p)


@pytest.fixture
def store(tmp_path):
    with Store.open(tmp_path / "state.db") as s:
        yield s


def test_nothing_measured_keeps_the_defaults(tmp_path, store):
    assert derive_transport.derive(_spec(tmp_path), store) is None


def test_streams_from_doctor_and_pacing_where_the_round_is_several_bdps(tmp_path, store):
    store.add_link_probe(spec_path="other.toml", links=BOTH)
    tiny = derive_transport.derive(_spec(tmp_path), store)
    # the fewest streams that carried 90% of the link; the tiny round (~0.5 MB) is one BDP: unpaced
    assert tiny["streams"] == 8 and tiny["link_pace"] == {} and tiny["source"] == "doctor"
    small = derive_transport.derive(_spec(tmp_path, "small"), store)
    # named by this spec's sites (the probe's were a and b), paced to 1.03x each link's best
    assert small["streams"] == 8 and small["link_pace"] == {"east->west": 49.2, "west->east": 49.2}
    assert "8 stream(s)" in derive_transport.describe(small) and "east->west 49.2" in derive_transport.describe(small)


@pytest.mark.parametrize("extra", ["transport_streams = 4", "transport_pace_mbit = 0", "transport = \"gloo\"",
                                   'mode = "async"'])
def test_a_spec_that_sets_its_transport_is_left_alone(tmp_path, store, extra):
    store.add_link_probe(spec_path="x", links=BOTH)
    assert derive_transport.derive(_spec(tmp_path, extra=extra), store) is None


def test_only_a_recent_measurement_of_every_direction_between_these_leaders(tmp_path, store):
    spec, now = _spec(tmp_path), time.time()
    store.add_link_probe(spec_path="x", links=BOTH, created=now - derive_transport.MAX_AGE_S - 60)
    assert derive_transport.derive(spec, store, now) is None  # too old: another WAN, perhaps
    store.add_link_probe(spec_path="x", links=[_link("10.9.1.10", "10.9.3.10"), _link("10.9.3.10", "10.9.1.10")])
    store.add_link_probe(spec_path="x", links=BOTH[:1], created=now - 10)  # one direction only
    assert derive_transport.derive(spec, store, now) is None
    store.add_link_probe(spec_path="x", links=BOTH, created=now - 100)  # older than the partial one, but whole
    assert derive_transport.derive(spec, store, now)["streams"] == 8


@pytest.mark.parametrize("bad", [
    [[1, math.nan], [2, 16.0]], [[1, math.inf]], [[0, 8.0]], [[1, -8.0]], "8 streams", [[1]], [["1", 8.0]],
])
def test_a_measurement_with_figures_no_probe_gives_is_passed_over(tmp_path, store, bad):
    store.add_link_probe(spec_path="x", links=[dict(x, sweep=bad) for x in BOTH])
    store.add_link_probe(spec_path="x", links=[{"not": "a link"}])
    store.add_link_probe(spec_path="x", links=[dict(x, rtt_ms=-1.0) for x in BOTH])
    assert derive_transport.derive(_spec(tmp_path), store) is None


def test_tune_h_links_count_too(tmp_path, store):
    store.add_tune(spec_path="x", links=BOTH, step_s=0.1, payload_bytes=1, h=100, budget=0.1, prediction={})
    got = derive_transport.derive(_spec(tmp_path), store)
    assert got["streams"] == 8 and got["source"] == "tune-h"


def test_a_relaunch_reuses_what_the_run_started_with(tmp_path, store):
    spec = _spec(tmp_path, "small")
    store.add_link_probe(spec_path="x", links=BOTH)
    run = store.create_run(spec)
    fresh = derive_transport.apply(spec, store, run.id, fresh=True)
    assert fresh.diloco.transport_streams == 8 and fresh.diloco.transport_link_pace_mbit["east->west"] == 49.2
    assert [e.event for e in store.events(run.id, kinds=["transport"])] == ["transport"]
    # a newer measurement of a faster link must not reach a site relaunched into the running exchange
    fast = [_link(x["src_host"], x["dst_host"], sweep=[[1, 90.0], [2, 95.0]]) for x in BOTH]
    store.add_link_probe(spec_path="x", links=fast)
    assert derive_transport.derive(spec, store)["streams"] == 1
    again = derive_transport.apply(spec, store, run.id, fresh=False)
    assert again.diloco == fresh.diloco
    # a run that started with nothing derived relaunches with nothing derived
    other = store.create_run(dataclasses.replace(spec, run=dataclasses.replace(spec.run, name="other")))
    assert derive_transport.apply(spec, store, other.id, fresh=False).diloco == spec.diloco


def test_the_plan_launch_shows_says_what_it_will_derive(tmp_path, store):
    from dilococtl.runs import plan_summary

    assert plan_summary(_spec(tmp_path), store)["transport"] is None
    store.add_link_probe(spec_path="x", links=BOTH)
    assert plan_summary(_spec(tmp_path), store)["transport"]["streams"] == 8


def test_launch_says_when_it_has_nothing_to_derive_from(tmp_path, store):
    said: list[str] = []
    spec = _spec(tmp_path)
    run = store.create_run(spec)
    assert derive_transport.apply(spec, store, run.id, fresh=True, progress=said.append) is spec
    assert len(said) == 1 and "doctor SPEC --links" in said[0] and "4 streams, unpaced" in said[0], said
    said.clear()
    tuned = _spec(tmp_path, extra="transport_streams = 8")
    derive_transport.apply(tuned, store, store.create_run(tuned, run_id="r2").id, fresh=True, progress=said.append)
    assert said == [] and store.events(run.id, kinds=["transport"]) == []


def test_doctor_links_names_the_pair_it_could_not_measure_and_measures_the_others(tmp_path, monkeypatch):
    from dilococtl import doctor
    from dilococtl.errors import DilocoError
    from dilococtl.tune import measure as tune_measure
    from dilococtl.tune.measure import Link

    text = SPEC.format(preset="tiny", extra="") + '\n[[sites]]\nname = "north"\nhosts = ["10.9.3.10"]\nwork_dir = "/tmp/n"\n'
    (tmp_path / "three.toml").write_text(text)
    spec = load_spec(tmp_path / "three.toml")

    def measure(sub, pool, settings, say):
        a, b = (s.name for s in sub.sites)
        if b == "north" and a == "west":
            raise DilocoError("link probe west -> north: no answer in 25 s")
        return [Link(**dict(_link(sub.sites[0].hosts[0], sub.sites[1].hosts[0]), src=a, dst=b))]

    monkeypatch.setattr(tune_measure, "measure_links", measure)
    links, failed = doctor.measure_bandwidth(spec, None, lambda m: None)
    assert [(x.src, x.dst) for x in links] == [("east", "west"), ("east", "north")]
    assert [(f.src_site, f.dst_site, f.purpose, f.status) for f in failed] == [("west", "north", "bandwidth", "fail")]
    assert "no answer" in failed[0].detail
