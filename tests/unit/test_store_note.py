"""tune-h and the plan say when checkpoint uploads share the WAN links with the exchange (issue 35)."""

from __future__ import annotations

import tomlkit

from dilococtl.spec import load_spec
from dilococtl.spec_summary import crossing, notes
from dilococtl.spec_summary import store_note as note


def _spec(tmp_path, own: list[str], run_wide: str = "", replicas: int = 1):
    doc = {"run": {"name": "t"}, "model": {"preset": "tiny"}, "diloco": {"h": 10, "rounds": 2},
           "checkpoint": {"replicas": replicas, **({"store": run_wide} if run_wide else {})},
           "sites": [{"name": f"s{i}", "hosts": ["local"], **({"checkpoint_store": u} if u else {})}
                     for i, u in enumerate(own)]}
    p = tmp_path / "spec.toml"
    p.write_text(tomlkit.dumps(doc))
    return load_spec(p)


def test_each_site_near_its_own_store_stays_off_the_wan(tmp_path):
    spec = _spec(tmp_path, ["s3://a/x", "s3://b/x"])
    assert crossing(spec) == {} and note(spec) is None
    assert not any("checkpoint" in line for line in notes(spec))
    assert note(_spec(tmp_path, [""])) is None  # no store at all
    assert note(_spec(tmp_path, ["", ""], run_wide="")) is None


def test_replicas_and_shared_stores_cross_it(tmp_path):
    spec = _spec(tmp_path, ["s3://a/x", "s3://b/x"], replicas=2)  # each round also goes to the other region
    assert crossing(spec) == {"s0": ["s3://b/x"], "s1": ["s3://a/x"]}
    spec = _spec(tmp_path, ["", "s3://b/x"], run_wide="s3://shared/x")  # s0 on the run-wide store
    assert crossing(spec) == {"s0": ["s3://shared/x"]}
    spec = _spec(tmp_path, ["", ""], run_wide="s3://shared/x")  # one store for two regions
    assert crossing(spec) == {"s0": ["s3://shared/x"], "s1": ["s3://shared/x"]}
    line = note(spec)
    assert line.startswith("checkpoint: uploads share the WAN links with the exchange: s0 (1 store), s1 (1 store)")
    assert "\n" not in line and line in notes(spec)  # the plan (launch, spec check) shows it
