"""tune-h with Streaming DiLoCo's fragments (diloco.fragments): each exchange's bytes against what the
trainer sends, a round of F whole exchanges, its output, and the bandwidth an H needs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dilococtl.errors import BadInput
from dilococtl.spec import load_spec
from dilococtl.store import Store
from dilococtl.tune.choose import choose, net_of, plan
from dilococtl.tune.history import rounds_against_model
from dilococtl.tune.measure import Link
from dilococtl.tune.model import exchange_idle, scaled, sync_round
from dilococtl.tune.transfer import (
    GUARD_DIGEST_BYTES,
    Path_,
    Transport,
    exchanges,
    fragment_payload_bytes,
    param_shapes,
    phases,
)
from trainer.rules import codec_spec, fragments
from trainer.rules.diloco_config import DilocoConfig
from trainer.rules.model_config import ModelConfig

SPEC = """[run]
name = "frag"

[model]
preset = "{preset}"

[diloco]
h = {h}
compression = "{codec}"
fragments = {f}
transport_loopback_clear = false  # WAN links between these local sites, not loopback

[[sites]]
name = "a"
hosts = ["local"]
work_dir = "{root}/a"

[[sites]]
name = "b"
hosts = ["local"]
work_dir = "{root}/b"
"""
STEPS = {"source": "bench", "per_site": {"a": 0.08, "b": 0.1}}  # the slower site governs


def _spec(tmp_path: Path, f: int, codec: str = "int8", h: int = 100, preset: str = "tiny"):
    p = tmp_path / f"spec-{f}-{codec.replace(':', '_')}.toml"
    p.write_text(SPEC.format(preset=preset, h=h, codec=codec, f=f, root=tmp_path))
    return load_spec(p)


def _links(mbit: float, rtt: float, restarts: bool = False) -> list[Link]:
    return [Link(src=a, dst=b, src_host="local", dst_host="local", mbit=mbit, rtt_ms=rtt, restarts_idle=restarts)
            for a, b in (("a", "b"), ("b", "a"))]


# --- each exchange's bytes are the trainer's ---------------------------------------------------------

@pytest.mark.parametrize("codec", ["none", "int8", "fp4", "powersgd:16+int8", "topk:0.01+int8", "sparse:0.01"])
@pytest.mark.parametrize("f", [1, 2, 4, 7])
def test_each_fragments_payload_is_what_the_trainer_sends(codec, f):
    from trainer.model import build_model

    cfg = ModelConfig(preset="tiny")
    params = list(build_model(cfg, seed=0, device="meta").parameters())
    d = DilocoConfig(compression=codec, fragments=f)
    # the trainer (trainer/modes/loop.py): split by the parameters' sizes, each fragment its own codec and plan
    want = []
    for i, idx in enumerate(fragments.split([p.numel() for p in params], f)):
        comp = fragments.compressor(d, seed=0, site=0, fragment=i)
        comp.prepare([tuple(params[j].shape) for j in idx])
        want.append(comp.plan.payload_bytes)
        assert comp.plan.payload_bytes == codec_spec.payload_bytes(codec, [tuple(params[j].shape) for j in idx],
                                                                   d.codec_options())
    got = fragment_payload_bytes(codec, param_shapes(cfg), d.codec_options(), f)
    assert got == want and len(got) == f
    # and the exchanges the model times carry those bytes (the guard gathers each contribution whole)
    xs = exchanges(codec, param_shapes(cfg), d.codec_options(), guarded=True, sites=2, fragments=f)
    if not codec.startswith("sparse"):  # the sparse codec's sharded reduction is timed as a mean of its parts
        assert [sum(n for _, n in x) for x in xs] == want


def test_three_sites_digest_every_exchange():
    xs = exchanges("int8", param_shapes(ModelConfig(preset="tiny")), sites=3, fragments=4)
    assert [x[-1] for x in xs] == [("gather", GUARD_DIGEST_BYTES)] * 4


@pytest.mark.parametrize("f", [0, -1, 10_000])
def test_a_fragment_count_the_model_cannot_cut_is_bad_input(f):
    with pytest.raises(BadInput, match="diloco.fragments"):
        exchanges("int8", param_shapes(ModelConfig(preset="tiny")), fragments=f)


# --- a round of F whole exchanges ----------------------------------------------------------------------

def test_four_fragments_pay_the_fixed_costs_four_times_for_a_quarter_of_the_peak(tmp_path):
    one = plan(_spec(tmp_path, 1), _links(10, 100), STEPS, budget=0.1)
    four = plan(_spec(tmp_path, 4), _links(10, 100), STEPS, budget=0.1)
    # the same bytes a round (a 4-byte weight per exchange more), the peak about a quarter: tiny's largest
    # fragment is 25.3% of its parameters (trainer.rules.fragments.split)
    assert (one.fragments, four.fragments) == (1, 4)
    assert sum(four.fragment_payload_bytes) == one.payload_bytes + 3 * 4 == four.payload_bytes
    assert one.peak_exchange_bytes == one.payload_bytes
    assert 0.25 <= four.peak_exchange_bytes / one.peak_exchange_bytes < 0.255
    # each exchange pays its own quorum and weight all-gather: 4 times F = 1's; so the round is longer
    b1, b4 = one.choice.breakdown, four.choice.breakdown
    assert b4["quorum_s"] == pytest.approx(4 * b1["quorum_s"])
    assert b4["weight_s"] == pytest.approx(4 * b1["weight_s"])
    assert b4["setup_s"] == pytest.approx(b1["setup_s"])  # the mesh is built once per quorum
    assert four.choice.sync_s > one.choice.sync_s + 3 * (b1["quorum_s"] + b1["weight_s"])
    assert four.choice.h >= one.choice.h
    # the round is the sum of its exchanges, each at its offset (trainer.rules.fragments.offsets)
    ex = four.choice.exchanges
    assert [x["after_step"] for x in ex] == fragments.offsets(four.choice.h, 4)
    assert sum(x["sync_s"] for x in ex) == pytest.approx(four.choice.sync_s)
    assert max(x["payload_s"] for x in ex) < one.choice.breakdown["payload_s"]
    # H keeps the round's whole sync within the budget, not one exchange's
    assert four.choice.sync_s <= 0.1 * four.choice.h * 0.1 < four.choice.sync_s + 0.1 * 10 * 0.1


def test_one_fragment_is_the_unfragmented_model(tmp_path):
    spec = _spec(tmp_path, 1)
    res = plan(spec, _links(10, 100, restarts=True), STEPS, budget=0.1)
    ph = phases("int8", param_shapes(spec.model), spec.diloco.codec_options(), True, 2)
    net = net_of(_links(10, 100, restarts=True), res.streams, Transport(kind="tls", streams=res.streams))
    c = choose(mode="sync", sites=["a", "b"], net=net, step_by_site=STEPS["per_site"], ph=ph,
                          lighthouse_site="a", budget=0.1, transport=Transport(kind="tls", streams=res.streams))
    assert res.phases == ph and (res.choice.h, res.choice.sync_s) == (c.h, c.sync_s)
    assert len(res.choice.exchanges) == 1 and res.choice.exchanges[0]["after_step"] == res.choice.h


def test_exchanges_idle_only_the_steps_between_them():
    assert exchange_idle(100, 1, 0.1) == pytest.approx([10.0])
    assert exchange_idle(100, 4, 0.1) == pytest.approx([2.5, 2.5, 2.5, 2.5])
    assert exchange_idle(10, 3, 1.0) == pytest.approx([3.0, 3.0, 4.0])  # offsets 3, 6, 10


def test_restarting_windows_restart_from_the_shorter_idle_between_exchanges(tmp_path):
    # a host that restarts idle connections: at the chosen H each exchange follows H/F steps of idle, not H
    spec = _spec(tmp_path, 4, codec="none", preset="small")
    links = _links(50, 80, restarts=True)
    res = plan(spec, links, STEPS, budget=0.1)
    tr = Transport(kind="tls", streams=res.streams)
    net = net_of(links, res.streams, tr)
    xs = exchanges("none", param_shapes(spec.model), spec.diloco.codec_options(), True, 2, 4)
    idle = exchange_idle(res.choice.h, 4, 0.1)
    want = [sync_round(x, ["a", "b"], net, lighthouse_site="a", transport=tr, idle_s=i)["sync_s"]
            for x, i in zip(xs, idle, strict=True)]
    assert [x["sync_s"] for x in res.choice.exchanges] == pytest.approx(want)
    assert res.choice.breakdown["restart_s"] > 0


# --- output -------------------------------------------------------------------------------------------

def test_json_and_prediction_carry_each_exchange(tmp_path):
    res = plan(_spec(tmp_path, 4), _links(10, 100), STEPS, budget=0.1)
    doc = json.loads(json.dumps(res.to_json()))
    assert doc["fragments"] == 4 and doc["fragment_payload_bytes"] == res.fragment_payload_bytes
    assert doc["peak_exchange_bytes"] == max(res.fragment_payload_bytes)
    assert [x["after_step"] for x in doc["choice"]["exchanges"]] == [25, 50, 75, 100]
    p = json.loads(json.dumps(res.prediction()))
    assert p["fragments"] == 4 and p["peak_exchange_bytes"] == doc["peak_exchange_bytes"]
    assert len(p["exchanges"]) == 4 and p["bandwidth"]["h"] == 100
    lines = res.exchange_lines()
    assert lines[0].startswith("fragments 4: 4 exchanges a round, after inner steps 25, 50, 75, 100 of H = 100")
    assert f"peak {res.peak_exchange_bytes:,}" in lines[0]
    assert lines[1].startswith("each exchange pays its own quorum, weight and payload: ")
    assert lines[1].count(" s; ") == 1 and lines[1].endswith(f"{res.choice.sync_s:.3f} s a round")


def test_an_unfragmented_tune_says_nothing_of_fragments(tmp_path):
    res = plan(_spec(tmp_path, 1), _links(10, 100), STEPS, budget=0.1)
    assert [x for x in res.exchange_lines() if x.startswith("fragments")] == []


def test_a_fragmented_tune_is_not_replayed_as_one_exchange(tmp_path):
    spec = _spec(tmp_path, 4, h=5)
    res = plan(spec, _links(10, 40), STEPS, budget=0.1)
    with Store.open() as store:
        run = store.create_run(spec)
        store.add_tune(spec_path=str(Path(spec.path).resolve()), links=[dataclasses.asdict(x) for x in res.links],
                       step_s=0.1, payload_bytes=res.payload_bytes, h=5, budget=0.1, prediction=res.prediction())
        assert rounds_against_model(store, run) is None


# --- the bandwidth an H needs ---------------------------------------------------------------------

@pytest.mark.parametrize("f", [1, 4])
def test_the_bandwidth_an_h_needs_is_the_least_that_meets_the_budget(tmp_path, f):
    spec = _spec(tmp_path, f, h=200)
    links = _links(0.2, 100)
    res = plan(spec, links, STEPS, budget=0.1)
    b = res.bandwidth
    assert res.choice.h > 200 and b["h"] == 200 and b["scale"] > 1  # 0.2 Mbit/s is too slow for H = 200
    assert b["mbit"] == pytest.approx(0.2 * b["scale"])
    # links that much faster: tune-h chooses H = 200 or less; 1% slower: more than 200
    faster = [dataclasses.replace(x, mbit=x.mbit * b["scale"]) for x in links]
    assert plan(spec, faster, STEPS, budget=0.1).choice.h <= 200
    slower = [dataclasses.replace(x, mbit=x.mbit * b["scale"] / 1.01) for x in links]
    assert plan(spec, slower, STEPS, budget=0.1).choice.h > 200
    assert res.exchange_lines()[-1].startswith(f"H = 200 (the spec's) needs links at {b['scale']:.2f}x")


def test_four_fragments_need_more_bandwidth_for_the_same_h(tmp_path):
    one = plan(_spec(tmp_path, 1, h=100), _links(10, 100), STEPS, budget=0.1).bandwidth
    four = plan(_spec(tmp_path, 4, h=100), _links(10, 100), STEPS, budget=0.1).bandwidth
    assert four["scale"] > one["scale"]  # the fixed costs paid 4 times leave less of the budget to the bytes


def test_an_h_whose_round_trips_alone_break_the_budget_needs_no_bandwidth(tmp_path):
    # H = 10 of 100 ms steps: 0.1 s of budget, under 4 exchanges' 100 ms quorum round trips
    res = plan(_spec(tmp_path, 4, h=10), _links(10, 100), STEPS, budget=0.1)
    assert res.bandwidth == {"h": 10, "scale": None, "mbit": None}
    assert "meets the budget at no bandwidth" in res.exchange_lines()[-1]


def test_scaled_links_keep_their_round_trips():
    net = {("a", "b"): Path_(mbit=10, rtt_ms=80, stream_mbit=4, pace_mbit=9.0),
           ("b", "a"): Path_(mbit=10, rtt_ms=80)}
    s = scaled(net, 3.0)
    assert s[("a", "b")] == Path_(mbit=30, rtt_ms=80, stream_mbit=12, pace_mbit=27.0)
    assert s[("b", "a")] == Path_(mbit=30, rtt_ms=80)  # unpaced (None: the transport's) stays so
