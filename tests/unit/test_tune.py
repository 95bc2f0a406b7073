"""tune-h: parameter shapes, the sync-time model and the choice of H against hand-computed cases,
spec writing, the store record and the self-check, and the CLI's bad-input paths."""

from __future__ import annotations

import json
import math
import socket
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dilococtl.cli import app
from dilococtl.errors import BadInput
from dilococtl.spec import load_spec
from dilococtl.spec_sites import lighthouse_host
from dilococtl.store import Store
from dilococtl.tune.choose import (
    CANDIDATE_CODECS,
    check_limits,
    choose,
    derive_link_pace,
    derive_streams,
    lands_at,
    min_h,
    net_of,
    plan,
    rounds_at,
    site_of_host,
    table,
    transport_model,
)
from dilococtl.tune.defaults import FEW_ROUNDS
from dilococtl.tune.history import prediction_for, rounds_against_model, tuned_land
from dilococtl.tune.measure import (
    Link,
    agg_mbit,
    exchange_streams,
    measure_steps,
    probe_counts,
    probe_links,
    step_from_records,
)
from dilococtl.tune.model import async_round, sync_round
from dilococtl.tune.tls_model import tls_arrivals, tls_collective_s, tls_last_site, tls_round, wave_s, waves
from dilococtl.tune.transfer import (
    CLEAR_CPU_S_PER_GB,
    GLOO,
    TLS_COLLECTIVE_S,
    TLS_CPU_S_PER_GB,
    Path_,
    Transport,
    cold_send_s,
    collective_s,
    param_shapes,
    phases,
    replicas,
    restart_window,
)
from dilococtl.tune.tune_h import write_h
from trainer.rules import outer_rule, sync_rule
from trainer.rules.model_config import ModelConfig, param_count

SPEC = """# two local sites
[run]
name = "tuned"

[model]
preset = "tiny"  # the CPU test model

[diloco]
h = 5  # inner steps per round
compression = "none"
transport_loopback_clear = false  # the tests model WAN links between these local sites, not loopback

[[sites]]
name = "a"
hosts = ["local"]
work_dir = "{root}/a"

[[sites]]
name = "b"
hosts = ["local"]
work_dir = "{root}/b"
"""


def _spec_file(tmp_path: Path, text: str = SPEC) -> Path:
    p = tmp_path / "spec.toml"
    p.write_text(text.format(root=tmp_path))
    return p


def _net(mbit: float, rtt_ms: float, sites: list[str]) -> dict:
    return {(a, b): Path_(mbit=mbit, rtt_ms=rtt_ms) for a in sites for b in sites if a != b}


# --- parameter shapes and payload ------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [
    ModelConfig(preset="tiny"),
    ModelConfig(preset="tiny", tie_embeddings=True),
    ModelConfig(preset="tiny", dim=96, n_heads=6, n_kv_heads=2, ffn_hidden=200, n_layers=3, vocab_size=300),
])
def test_param_shapes_match_the_real_model(cfg):
    from trainer.model import build_model

    real = [tuple(p.shape) for p in build_model(cfg, seed=0, device="meta").parameters()]
    assert param_shapes(cfg) == real
    assert sum(math.prod(s) for s in real) == param_count(cfg)


def test_phases_follow_the_trainer_collectives():
    # one 1024 x 2 matrix = 2048 values; int8: fp32 weight 4 B + 2 chunk scales 8 B + 2048 B, gathered
    assert phases("int8", [(1024, 2)], guarded=False) == [("qsum", 2060)]
    # fp32: weight + 2048 * 4 bytes, all-reduced
    assert phases("none", [(1024, 2)], guarded=False) == [("sum", 8196)]
    # PowerSGD rank 2 on 1024 x 512: P = 1024 x 2 (+ weight), then Q = 512 x 2, both summed
    assert phases("powersgd:2", [(1024, 512)], guarded=False) == [("sum", 4 + 1024 * 2 * 4), ("sum", 512 * 2 * 4)]
    # the guard (sync, overlap) gathers every contribution whole, so each site decodes it itself, and
    # from 3 sites on the digest of the average each decoded
    assert phases("powersgd:2", [(1024, 512)]) == [("gather", 4 + 1024 * 2 * 4), ("gather", 512 * 2 * 4)]
    assert phases("none", [(1024, 2)], sites=3) == [("gather", 8196), ("gather", 32)]


# --- the sync model, by hand -----------------------------------------------------------------------

def test_two_sites_allreduce_by_hand():
    net = _net(50, 20, ["a", "b"])
    br = sync_round([("sum", 1_000_000)], ["a", "b"], net, lighthouse_site="a")
    # quorum: b's round trip to the Lighthouse at a = 0.020 s
    assert br["quorum_s"] == pytest.approx(0.020)
    # weight and timings, 24 bytes gathered: K-1 = 1 step of (0.020 + 24 B * 8 / 50e6)
    assert br["weight_s"] == pytest.approx(0.020 + 3.84e-6)
    # payload: 2 steps of (0.020 s + 500000 B * 8 / 50e6 = 0.08 s) = 0.20 s
    assert br["payload_s"] == pytest.approx(0.20)
    assert br["sync_s"] == pytest.approx(0.24000384)
    # slowest step 0.05 s, budget 0.1: H >= 0.24000384 / 0.005 = 48.0001 -> 50
    c = choose(mode="sync", sites=["a", "b"], net=net, step_by_site={"a": 0.04, "b": 0.05},
               ph=[("sum", 1_000_000)], lighthouse_site="a", budget=0.1)
    assert (c.h, c.step_s, c.within_max) == (50, 0.05, True)
    assert c.efficiency == pytest.approx(2.5 / (2.5 + 0.24000384))
    assert c.sync_share == pytest.approx(0.24000384 / 2.74000384)
    # 40 would break the budget: 0.24 > 0.1 * 40 * 0.05 = 0.2
    assert 0.24000384 > 0.1 * 40 * 0.05


def test_four_sites_allgather_takes_the_slowest_ring_edge():
    sites = ["d", "a", "c", "b"]  # ring in name order: a -> b -> c -> d -> a
    net = _net(100, 10, sites)
    net[("c", "d")] = Path_(mbit=20, rtt_ms=40)  # on the ring: governs every step
    net[("a", "c")] = Path_(mbit=1, rtt_ms=500)  # not on the ring: ignored by the collectives
    br = sync_round([("gather", 250_000)], sites, net, lighthouse_site="a")
    # gather: K-1 = 3 steps of max(0.010 + 0.02, 0.040 + 250000 * 8 / 20e6 = 0.14) = 0.42 s
    assert br["payload_s"] == pytest.approx(0.42)
    # weight and timings: K-1 = 3 steps of (0.040 + 24 B * 8 / 20e6)
    assert br["weight_s"] == pytest.approx(3 * 0.0400096)
    # quorum: farthest of b, c, d to a = 10 ms (c -> a is 10 ms; a -> c is the slow one)
    assert br["quorum_s"] == pytest.approx(0.010)
    c = choose(mode="sync", sites=sites, net=net, step_by_site=dict.fromkeys(sites, 0.01),
               ph=[("gather", 250_000)], lighthouse_site="a", budget=0.05, max_h=1100)
    # 0.5500288 / (0.05 * 0.01) = 1100.06 -> 1110
    assert (c.h, c.within_max) == (1110, False)
    assert choose(mode="sync", sites=sites, net=net, step_by_site=dict.fromkeys(sites, 0.01),
                  ph=[("gather", 250_000)], lighthouse_site="a", budget=0.05, max_h=1110).within_max is True


def test_four_sites_allreduce_by_hand():
    # sum of n over K=4: 6 steps of n/4 bytes; 100 Mbit, 10 ms: 6 * (0.010 + 1e6 * 8 / 100e6) = 0.54 s
    edges = [Path_(mbit=100, rtt_ms=10)] * 4
    assert collective_s("sum", 4_000_000, 4, edges) == pytest.approx(0.54)
    # two processes per site exchange at once over the same links: the bytes double
    assert collective_s("sum", 4_000_000, 4, edges, reps=2) == pytest.approx(6 * (0.010 + 0.16))
    assert collective_s("gather", 10, 1, edges) == 0.0


def test_idle_restart_by_hand():
    # 50 Mbit/s, 80 ms: the link holds 500,000 bytes; the window restarts at 10 x 1448 = 14,480 bytes
    # and doubles every round trip: after t of them 14,480 x (2^t - 1) bytes are out, until the
    # window holds the link (t = log2(500000 / 14480), 485,520 bytes out); the rest at the rate
    p = Path_(mbit=50, rtt_ms=80, restarts_idle=True)
    assert cold_send_s(200_000, p) == pytest.approx(0.08 * math.log2(200_000 / 14_480 + 1))
    full = 0.08 * math.log2(500_000 / 14_480)
    assert cold_send_s(500_000, p) == pytest.approx(full + 14_480 * 8 / 50e6)
    assert cold_send_s(10_000_000, p) == pytest.approx(full + 9_514_480 * 8 / 50e6)
    # two connections share the link: 250,000 bytes in flight each
    assert cold_send_s(500_000, p, reps=2) == pytest.approx(
        0.08 * math.log2(250_000 / 14_480) + 264_480 * 8 / 25e6)
    assert cold_send_s(500_000, Path_(mbit=10, rtt_ms=10)) == pytest.approx(0.4)  # BDP < 10 MSS: the rate
    # a round of two sites summing 500 kB: 2 steps of (0.08 + 250 kB at the rate) = 0.24 s steady; from
    # a restarted window the round's 500 kB take 0.4111 s, which the steps' round trips overlap
    warm = sync_round([("sum", 500_000)], ["a", "b"], _net(50, 80, ["a", "b"]), lighthouse_site="a")
    net = {k: Path_(mbit=50, rtt_ms=80, restarts_idle=True) for k in _net(50, 80, ["a", "b"])}
    cold = sync_round([("sum", 500_000)], ["a", "b"], net, lighthouse_site="a")
    assert warm["restart_s"] == 0.0 and cold["payload_s"] == warm["payload_s"] == pytest.approx(0.24)
    assert cold["restart_s"] == pytest.approx(full + 14_480 * 8 / 50e6 - 0.24)
    assert cold["sync_s"] == pytest.approx(warm["sync_s"] + cold["restart_s"])
    # async: the push (500 kB) and the θ its answer brings back (2 MB), each the longer of the two, in
    # one request: one round trip
    assert async_round(500_000, 2_000_000, "b", "a", net) == pytest.approx(
        0.08 + max(0.08, full + 14_480 * 8 / 50e6) + full + 1_514_480 * 8 / 50e6)


def test_compressed_payload_by_hand():
    # int8 of a 1024 x 2 matrix: 2060 bytes averaged in shards; K=2 at 1 Mbit, 100 ms RTT:
    # 2 steps of 0.1 + 1030 * 8 / 1e6 = 0.21648 s; weight 0.1 + 24 * 8 / 1e6 = 0.100192; quorum 0.1
    ph = phases("int8", [(1024, 2)], guarded=False)
    net = _net(1, 100, ["a", "b"])
    br = sync_round(ph, ["a", "b"], net, lighthouse_site="a")
    assert br["sync_s"] == pytest.approx(0.21648 + 0.100192 + 0.1)
    # guarded (every contribution gathered whole): 1 step of 0.1 + 2060 * 8 / 1e6
    br = sync_round(phases("int8", [(1024, 2)]), ["a", "b"], net, lighthouse_site="a")
    assert br["sync_s"] == pytest.approx(0.11648 + 0.100192 + 0.1)
    # step 2 ms, budget 0.2: 0.416672 / 0.0004 = 1041.68 -> 1050
    c = choose(mode="sync", sites=["a", "b"], net=net, step_by_site={"a": 0.002, "b": 0.002}, ph=ph,
               lighthouse_site="a", budget=0.2)
    assert c.h == 1050
    # uncompressed (8196 bytes) needs more
    c32 = choose(mode="sync", sites=["a", "b"], net=net, step_by_site={"a": 0.002, "b": 0.002},
                 ph=phases("none", [(1024, 2)]), lighthouse_site="a", budget=0.2)
    assert c32.sync_s == pytest.approx((0.1 + 2 * 0.032784) + 0.100192 + 0.1)  # gathered: 1 step of all 8196 B
    # 0.36576 / 0.0004 = 914.4 -> 920
    assert c32.h == 920


def test_overlap_hides_the_exchange_behind_compute():
    # sync 0.24 s, step 0.05 s: H = 10 computes 0.5 s > 0.24 s, nothing is exposed
    net = _net(50, 20, ["a", "b"])
    c = choose(mode="overlap", sites=["a", "b"], net=net, step_by_site={"a": 0.05, "b": 0.05},
               ph=[("sum", 1_000_000)], lighthouse_site="a", budget=0.1)
    assert (c.h, c.efficiency) == (10, 1.0)
    # exposed = sync - H * step must be <= budget * H * step: sync 3 s, step 0.05 -> 3 <= 1.1 * H * 0.05 -> H >= 54.5
    assert min_h(3.0, 0.05, 0.1, "overlap") == 60
    # landing a tenth into the next round: only that tenth hides the exchange, sync <= 0.2 * H * step
    assert min_h(3.0, 0.05, 0.1, "overlap", land=0.1) == 300
    assert sync_rule.efficiency(60, 0.05, 3.0, "overlap") == pytest.approx(3.0 / 3.0)


def test_async_each_site_pushes_and_pulls_on_its_own_link():
    net = _net(80, 20, ["a", "b"])
    net[("b", "a")] = Path_(mbit=8, rtt_ms=20)  # b's uplink is slow
    # service beside the Lighthouse at a: b pushes 1e6 B up (0.02 + 1.0 s), θ (4e6 B) comes back in the
    # answer (0.4 s): one round trip
    assert async_round(1_000_000, 4_000_000, "b", "a", net) == pytest.approx(1.42)
    assert async_round(1_000_000, 4_000_000, "a", "a", net) == 0.0
    c = choose(mode="async", sites=["a", "b"], net=net, step_by_site={"a": 0.1, "b": 0.2},
               ph=[("gather", 1_000_000)], pull_bytes=4_000_000, lighthouse_site="a", budget=0.1, land=0.1)
    # the push runs behind the next round's first tenth: exposed = 1.42 - 0.1 * H * 0.2 <= 0.1 * H * 0.2
    # -> H >= 35.5 -> 40 for b; a needs the minimum 10
    assert c.per_site["b"]["h"] == 40 and c.per_site["a"]["h"] == 10
    assert c.h == 40
    assert c.efficiency == pytest.approx(8 / (8 + 1.42 - 0.8))


def test_min_h_is_the_smallest_grid_point():
    for sync, step, budget in [(0.22, 0.05, 0.1), (1.0, 0.01, 0.05), (0.0, 0.1, 0.1), (7.3, 0.003, 0.25)]:
        h = min_h(sync, step, budget)
        assert h % 10 == 0 and h >= 10
        assert sync <= budget * h * step * (1 + 1e-9)
        assert h == 10 or sync > budget * (h - 10) * step


@pytest.mark.parametrize("budget", [0.0, 1.0, -0.1, 1.5])
def test_budget_outside_0_1_is_refused(budget):
    with pytest.raises(BadInput, match="--budget"):
        min_h(1.0, 0.1, budget)
    with pytest.raises(BadInput, match="--budget"):
        check_limits(budget, 1000)


def test_single_site_needs_no_exchange():
    c = choose(mode="sync", sites=["a"], net={}, step_by_site={"a": 0.1}, ph=[("sum", 10**9)], budget=0.1)
    assert (c.h, c.sync_s, c.efficiency) == (10, 0.0, 1.0)


# --- plan: from a spec and measurements -----------------------------------------------------------

def _links(mbit: float, rtt: float) -> list[Link]:
    return [Link(src=a, dst=b, src_host="local", dst_host="local", mbit=mbit, rtt_ms=rtt)
            for a, b in (("a", "b"), ("b", "a"))]


GLOO_SPEC = SPEC.replace('compression = "none"', 'compression = "none"\ntransport = "gloo"')


def test_plan_uses_the_specs_model_codec_and_processes(tmp_path):
    spec = load_spec(_spec_file(tmp_path, GLOO_SPEC))
    res = plan(spec, _links(10, 40), {"source": "bench", "per_site": {"a": 0.01, "b": 0.02}}, budget=0.1)
    shapes = param_shapes(spec.model)
    n = 4 + 4 * sum(math.prod(s) for s in shapes)  # fp32 + the weight
    assert res.payload_bytes == n and res.phases == [("gather", n)] and res.replicas == 1
    sync = 0.040 + (0.040 + 24 * 8 / 10e6) + (0.040 + n * 8 / 10e6)  # the guard's gather: 1 step of n
    assert res.choice.sync_s == pytest.approx(sync)
    assert res.choice.h == math.ceil(sync / (0.1 * 0.02) / 10) * 10


@pytest.mark.parametrize(("mode", "nproc", "copies", "streams"), [
    ("sync", 1, 1, 1), ("sync", 2, 2, 2), ("overlap", 40, 40, 16), ("async", 2, 1, 1)])
def test_copies_and_probe_streams_follow_the_exchange(tmp_path, mode, nproc, copies, streams):
    # sync/overlap: every local rank exchanges over its own gloo connection; async: the leader alone
    text = GLOO_SPEC.replace('compression = "none"', f'compression = "none"\nmode = "{mode}"')
    text = text.replace('hosts = ["local"]', f'hosts = ["local"]\nnproc_per_node = {nproc}')
    spec = load_spec(_spec_file(tmp_path, text))
    assert (replicas(spec), exchange_streams(spec)) == (copies, streams)
    res = plan(spec, _links(10, 40), {"source": "bench", "per_site": {"a": 0.01, "b": 0.02}}, budget=0.1)
    assert res.replicas == copies
    if mode == "async":  # the payload up and θ down once, for the whole site
        n = res.payload_bytes
        pull = 4 * sum(math.prod(x) for x in param_shapes(spec.model))
        assert res.choice.per_site["b"]["sync_s"] == pytest.approx(0.040 + (n + pull) * 8 / 10e6)  # one request


def test_plan_sizes_the_payload_with_the_specs_codec_options(tmp_path):
    from trainer.rules.codec_spec import CodecOptions, payload_bytes

    text = SPEC.replace('compression = "none"', 'compression = "int8"\ncodec_chunk = 64\ncodec_scale_dtype = "bf16"')
    spec = load_spec(_spec_file(tmp_path, text))
    res = plan(spec, _links(10, 40), {"source": "bench", "per_site": {"a": 0.01, "b": 0.02}}, budget=0.1)
    shapes = param_shapes(spec.model)
    assert res.payload_bytes == payload_bytes("int8", shapes, CodecOptions(chunk=64, scale_dtype="bf16"))
    assert res.payload_bytes != payload_bytes("int8", shapes)  # the defaults would size another message
    assert [r["h"] for r in res.table][:3] == sorted({5, 10, 20, res.choice.h})[:3]
    assert res.suggestion is None


def test_plan_names_a_codec_when_h_exceeds_the_maximum(tmp_path):
    spec = load_spec(_spec_file(tmp_path))
    steps = {"source": "bench", "per_site": {"a": 0.05, "b": 0.05}}
    res = plan(spec, _links(10, 20), steps, budget=0.1, max_h=50)
    assert not res.choice.within_max and res.choice.h > 50
    s = res.suggestion
    assert s is not None and s["h"] <= 50
    # the suggestion is the mildest codec of the list that fits: every milder one does not
    milder = CANDIDATE_CODECS[:CANDIDATE_CODECS.index(s["compression"])]
    for codec in milder:
        assert plan(spec, _links(10, 20), steps, budget=0.1, max_h=50, codec=codec).choice.h > 50
    assert plan(spec, _links(10, 20), steps, budget=0.1, max_h=50, codec=s["compression"]).choice.h == s["h"]


# --- writing H, records, self-check ----------------------------------------------------------------

def test_write_h_keeps_comments_and_layout(tmp_path):
    p = _spec_file(tmp_path)
    before = p.read_text()
    write_h(p, 120)
    after = p.read_text()
    assert after == before.replace("h = 5  # inner steps per round", "h = 120  # inner steps per round")
    assert load_spec(p).diloco.h == 120


def test_write_h_adds_a_diloco_table(tmp_path):
    p = _spec_file(tmp_path, SPEC.split("[diloco]")[0] + "[[sites]]" + SPEC.split("[[sites]]", 1)[1])
    assert "[diloco]" not in p.read_text()
    write_h(p, 30)
    assert tomllib.loads(p.read_text())["diloco"] == {"h": 30}
    assert "# the CPU test model" in p.read_text()


def _round_line(site: str, rnd: int, compute: float, sync: float, h: int = 5) -> str:
    return json.dumps({"kind": "round", "site": site, "round": rnd, "step": rnd * h, "h": h, "compute_s": compute,
                       "sync_s": sync, "bytes_sent": 0, "bytes_recv": 0, "k_active": 2, "k_nominal": 2,
                       "outer_lr": 0.7, "committed": True, "t": 1000.0 + rnd})


def test_prediction_for_compares_the_newest_matching_tune(tmp_path):
    p = _spec_file(tmp_path)
    spec = load_spec(p)
    with Store.open() as store:
        run = store.create_run(spec)
        assert prediction_for(store, run) is None
        store.ingest(run.id, "a", "local", "m", 10, [_round_line("a", 1, 3.0, 1.0), _round_line("a", 2, 3.0, 1.0)])
        store.ingest(run.id, "b", "local", "m", 10, [_round_line("b", 1, 2.0, 2.0)])
        abs_path = str(p.resolve())
        store.add_tune(spec_path=abs_path, links=[], step_s=0.1, payload_bytes=10, h=5, budget=0.1,
                       prediction={"sync_share": 0.3, "efficiency": 0.7}, created=1.0)
        store.add_tune(spec_path=abs_path, links=[], step_s=0.1, payload_bytes=10, h=5, budget=0.1,
                       prediction={"sync_share": 0.25, "efficiency": 0.75, "sync_s": 0.4}, created=2.0)
        store.add_tune(spec_path=abs_path, links=[], step_s=0.1, payload_bytes=10, h=50, budget=0.1,
                       prediction={"sync_share": 0.05}, created=3.0)  # a different H: not this run's
        got = prediction_for(store, run)
    assert got["h"] == 5 and got["predicted_sync_share"] == 0.25 and got["predicted_sync_s"] == 0.4
    # the records' sync seconds over their round seconds (issue 42): (1 + 1 + 2) / (4 + 4 + 4)
    assert got["measured_sync_share"] == pytest.approx(4 / 12)
    assert got["measured_rounds"] == 3


def test_step_time_from_an_earlier_run_of_the_same_config(tmp_path):
    p = _spec_file(tmp_path)
    spec = load_spec(p)
    with Store.open() as store:
        assert step_from_records(store, spec) is None
        run = store.create_run(spec)
        store.ingest(run.id, "a", "local", "m", 10, [_round_line("a", 1, 0.5, 1.0), _round_line("a", 2, 0.7, 1.0),
                                                 _round_line("a", 3, 0.6, 1.0)])
        assert step_from_records(store, spec) is None  # site b has no rounds yet
        store.ingest(run.id, "b", "local", "m", 10, [_round_line("b", 1, 1.0, 1.0)])
        got = step_from_records(store, spec)
        assert got["per_site"] == pytest.approx({"a": 0.6 / 5, "b": 1.0 / 5})
        assert got["source"] == f"run {run.id}"
        other = load_spec(_spec_file(tmp_path, SPEC.replace('preset = "tiny"', 'preset = "small"')))
        assert step_from_records(store, other) is None  # a different model
        assert measure_steps(spec, pool=None, source="records", store=store)["per_site"]["b"] == 0.2


# --- CLI: bad input writes nothing -------------------------------------------------------------------

def _no_tunes() -> bool:
    with Store.open() as store:
        return store.tunes() == []


@pytest.mark.parametrize("budget", ["0", "1", "1.5", "-0.2"])
def test_cli_budget_outside_0_1_exits_2(tmp_path, budget):
    p = _spec_file(tmp_path)
    before = p.read_text()
    r = CliRunner().invoke(app, ["tune-h", str(p), "--budget", budget, "--write"])
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--budget: must be in (0, 1)" in lines[0]
    assert p.read_text() == before and _no_tunes()


def test_cli_unreachable_site_exits_3(tmp_path):
    # 127.0.0.2 is loopback but not a "local" name: dilococtl dials SSH there, where nothing listens
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed
    text = SPEC.replace('hosts = ["local"]\nwork_dir = "{root}/a"', 'hosts = ["127.0.0.2"]\nwork_dir = "{root}/a"') \
        .replace('hosts = ["local"]\nwork_dir = "{root}/b"', 'hosts = ["127.0.0.3"]\nwork_dir = "{root}/b"') \
        + f"\n[ssh]\nport = {port}\nconnect_timeout_s = 2.0\n"
    p = _spec_file(tmp_path, text)
    before = p.read_text()
    r = CliRunner().invoke(app, ["tune-h", str(p), "--write"])
    assert r.exit_code == 3, r.output
    errors = [x for x in r.stderr.strip().splitlines() if x.startswith("error")]
    assert errors == [r.stderr.strip().splitlines()[-1]], r.stderr
    assert errors[0].startswith("error: site a: 127.0.0.2: unreachable: connection refused"), errors
    assert p.read_text() == before and _no_tunes()


def test_cli_bad_flags_exit_2(tmp_path):
    p = _spec_file(tmp_path)
    for args, msg in ((["--max-h", "5"], "--max-h"), (["--duration", "0"], "--duration"),
                      (["--port", "70000"], "--port"), (["--step-source", "guess"], "--step-source")):
        r = CliRunner().invoke(app, ["tune-h", str(p), *args])
        assert r.exit_code == 2 and msg in r.stderr, (args, r.output)
    assert _no_tunes()


# --- the TLS transport's model ---------------------------------------------------------------------

TLS = Transport(kind="tls", streams=4)


def test_chunking_follows_the_transports():
    # the tiny model's all-reduce over 2 sites: a 250,498-byte block in 64 KiB chunks, one per stream
    assert waves(250_498, TLS) == [(250_498, 65_536, 4)]
    # a large block: about two 1 MiB-bounded chunks per stream, in waves of S
    w = waves(64 << 20, TLS)
    assert len(w) == 16 and all(x == (4 << 20, 1 << 20, 4) for x in w)
    # the small preset's 21.6 MB block over S = 8: 24 chunks, three full waves (not 21 and a ragged one)
    w8 = waves(21_636_864, Transport(kind="tls", streams=8))
    assert [n for _, _, n in w8] == [8, 8, 8] and sum(b for b, _, _ in w8) == 21_636_864


def test_tls_round_by_hand_on_a_plain_link(tmp_path):
    # the default transport ("auto": TLS for a launched run), S = 4 from the spec's default
    spec = load_spec(_spec_file(tmp_path))
    res = plan(spec, _links(10, 40), {"source": "bench", "per_site": {"a": 0.01, "b": 0.02}}, budget=0.1)
    assert (res.transport, res.streams, res.streams_derived) == ("tls", 4, False)
    n = res.payload_bytes
    assert site_of_host(spec, lighthouse_host(spec)) == "a"
    # no rendezvous per step (gloo's whole RTT): a row or a block crosses one way, at the link's
    # rate. b arriving last: its request reaches the Lighthouse (at a) in 20 ms, a has the answer
    # at once, b 20 ms later; a's row is on its way to b by then (the weight costs b nothing but
    # its bytes); b's payload ends one crossing after a's second block, which left 20 ms after
    # b's first: 2 blocks + 2 crossings. a arriving last waits as long: 0 + 40 ms in the weight.
    eps, c = 24 * 8 / 10e6, TLS_COLLECTIVE_S
    block = n / 2 * 8 / 10e6
    # the guard's all-gather (each site decodes the other's bytes itself) is one crossing of n, not a
    # ring's two of n/2: a arriving last saves that second crossing; b arriving last still waits one
    # crossing for a's payload after its own late quorum answer
    want = 0.040 + eps + c + 2 * block + c
    assert res.choice.last_site == {"a": pytest.approx(want), "b": pytest.approx(want + 0.040)}
    assert res.choice.sync_s == pytest.approx(want + 0.040)
    br = res.choice.breakdown
    assert (br["quorum_s"], br["weight_s"], br["payload_s"]) in (
        (pytest.approx(0.040), pytest.approx(eps + c), pytest.approx(2 * block + 0.040 + c)),  # b last
        (pytest.approx(0.0), pytest.approx(0.040 + eps + c), pytest.approx(2 * block + 0.040 + c)))  # a last
    assert res.choice.breakdown["setup_s"] == pytest.approx(2.5 * 0.040)  # per quorum, not per round


def test_window_limited_streams_add_up_to_the_link():
    # 128 kB buffers at 80 ms: one connection carries 8 Mbit/s (80 kB per round trip) of a link
    # that S of them fill at 41 Mbit/s
    net = {(a, b): Path_(mbit=41, rtt_ms=80, stream_mbit=8) for a, b in (("a", "b"), ("b", "a"))}
    ph = [("sum", 500_996)]
    block, window = 250_498, 80_000
    ovh = TLS_COLLECTIVE_S
    # the tiny block's 4 chunks of 64 KiB: one wave on 4 streams, each chunk within its stream's
    # window, so the wave leaves at the link's rate (lab: 0.26-0.30 s exchanges, 0.29 s predicted)
    for s in (4, 8):
        got = tls_collective_s("sum", 500_996, ["a", "b"], net, 1, Transport(kind="tls", streams=s))
        assert got == pytest.approx(2 * (block * 8 / 41e6 + 0.040) + ovh), s
    # one stream: past its window, the chunks go at its own 8 Mbit/s
    one = tls_collective_s("sum", 500_996, ["a", "b"], net, 1, Transport(kind="tls", streams=1))
    assert (2 * block - window) * 8 / 8e6 <= one <= 2 * block * 8 / 8e6 + 0.040 + ovh
    gloo = sync_round(ph, ["a", "b"], {k: Path_(mbit=8, rtt_ms=80) for k in net})["payload_s"]
    tls = tls_round(ph, ["a", "b"], net, Transport(kind="tls", streams=8))["payload_s"]
    assert tls < 0.4 * gloo
    # pacing 16 Mbit/s over 8 streams: every byte at 2 Mbit/s per stream, 8 for the 4 busy ones
    paced = Transport(kind="tls", streams=8, pace_mbit=16)
    assert tls_collective_s("sum", 500_996, ["a", "b"], net, 1, paced) == pytest.approx(
        2 * (max(block * 8 / 8e6, 65_536 * 8 / 2e6) + 0.040) + ovh)


def test_a_chunk_past_its_streams_window_goes_at_the_streams_rate():
    p = Path_(mbit=100, rtt_ms=80, stream_mbit=10)  # window: 100 kB
    t = Transport(kind="tls", streams=1)
    assert wave_s((50_000, 50_000, 1), p, 1, t) == pytest.approx(50_000 * 8 / 100e6)  # in the window
    assert wave_s((1 << 20, 1 << 20, 1), p, 1, t) == pytest.approx(((1 << 20) - 100_000) * 8 / 10e6)
    # two processes of a site share the link
    assert wave_s((50_000, 50_000, 1), p, 2, t) == pytest.approx(50_000 * 8 / 50e6)


def test_tls_ring_waits_for_its_slowest_edge_and_pipelines_the_rest():
    sites = ["a", "b", "c"]
    fast = {(x, y): Path_(mbit=100, rtt_ms=20) for x in sites for y in sites if x != y}
    t = Transport(kind="tls", streams=1)
    n = 3 * 4 * (1 << 20)  # 4 MiB blocks: 4 waves of one 1 MiB chunk per ring step
    even = tls_collective_s("sum", n, sites, fast, 1, t)
    wave = (1 << 20) * 8 / 100e6
    # pipelined: each member's link is busy from the first wave of step 1 to the last of step 4
    # (a step's first chunk arrived while the step before still sent), then one crossing
    assert even == pytest.approx(16 * wave + 0.010 + TLS_COLLECTIVE_S)
    slow = dict(fast)
    slow[("b", "c")] = Path_(mbit=20, rtt_ms=120)
    got = tls_collective_s("sum", n, sites, slow, 1, t)
    # every step's data crosses b -> c once per step: at least 4 blocks at 20 Mbit/s
    assert got >= 4 * 4 * (1 << 20) * 8 / 20e6
    assert got < 4 * (4 * (1 << 20) * 8 / 20e6 + 0.060) + 4 * 4 * wave  # not the gloo-like sum


def test_tls_costs_cpu_where_the_link_is_free():
    sites = ["a", "b"]
    loop = {(x, y): Path_(mbit=1e6, rtt_ms=0.0) for x in sites for y in sites if x != y}
    n = 64 << 20
    t = Transport(kind="tls", streams=4)
    got = tls_collective_s("sum", n, sites, loop, 1, t)
    assert got == pytest.approx(TLS_CPU_S_PER_GB * 2 * n / 1e9 + TLS_COLLECTIVE_S)


def test_quantized_average_is_an_alltoall_then_a_gather():
    sites = ["a", "b", "c"]
    net = {(x, y): Path_(mbit=10, rtt_ms=40) for x in sites for y in sites if x != y}
    net[("a", "c")] = Path_(mbit=5, rtt_ms=40)  # not a ring edge (a -> b -> c -> a): the all-to-all uses it
    t = Transport(kind="tls", streams=1, min_chunk_bytes=1 << 20)
    n = 3 * 100_000
    got = tls_collective_s("qsum", n, sites, net, 1, t)
    a2a = 100_000 * 8 / 5e6 + 0.020
    gather = 2 * (100_000 * 8 / 10e6 + 0.020)
    assert got == pytest.approx(a2a + gather + 2 * TLS_COLLECTIVE_S)


def _sweep_links(sweep: list[list[float]], rtt: float = 80.0) -> list[Link]:
    return [Link(src=a, dst=b, src_host="local", dst_host="local", mbit=sweep[-1][1], rtt_ms=rtt,
                 streams=int(sweep[-1][0]), stream_mbit=sweep[0][1], sweep=sweep) for a, b in (("a", "b"), ("b", "a"))]


def test_streams_derived_from_the_bandwidth_delay_product(tmp_path):
    window = [[1, 8.0], [2, 15.9], [4, 31.0], [8, 44.0], [16, 41.0]]  # 50 Mbit/s x 80 ms, 128 kB windows
    plain = [[1, 47.5], [2, 47.8]]  # one connection fills it: the sweep stopped at 2
    assert derive_streams(_sweep_links(window)) == 8
    assert derive_streams(_sweep_links(plain)) == 1
    assert derive_streams(_sweep_links(window), reps=2) == 4  # two processes share the link
    assert derive_streams(_sweep_links(plain) + _sweep_links(window)) == 8  # the neediest link
    assert [agg_mbit(_sweep_links(window)[0], n) for n in (1, 3, 8, 64)] == [8.0, 15.9, 44.0, 44.0]

    p = _spec_file(tmp_path)  # sets no transport_streams
    spec = load_spec(p)
    assert probe_counts(spec) == [1, 2, 4, 8, 16] and exchange_streams(spec) == 16
    res = plan(spec, _sweep_links(window), {"source": "bench", "per_site": {"a": 0.01, "b": 0.02}})
    assert (res.transport, res.streams, res.streams_derived) == ("tls", 8, True)
    # the tiny model's round (~0.5 MB) is about one bandwidth-delay product (44 Mbit/s x 80 ms): unpaced
    assert res.payload_bytes < 2 * 440_000 and (res.link_pace, res.pace_derived) == ({}, False)
    # at 10 ms it is ~9 of them: the 8 streams of each link are paced together to 1.03x its best goodput
    res = plan(spec, _sweep_links(window, rtt=10.0), {"source": "bench", "per_site": {"a": 0.01, "b": 0.02}})
    paced = {"a->b": 45.3, "b->a": 45.3}
    assert (res.streams, res.pace_mbit, res.link_pace, res.pace_derived) == (8, 0.0, paced, True)
    assert res.prediction()["streams"] == 8 and res.prediction()["link_pace"] == paced
    write_h(p, res.choice.h, res.streams, res.link_pace)
    written = tomllib.loads(p.read_text())["diloco"]
    assert (written["h"], written["transport_streams"], written["transport_link_pace_mbit"]) == (res.choice.h, 8, paced)
    # now the spec sets S and pacing: the probe measures one stream and the exchange's S, both are kept
    spec = load_spec(p)
    assert probe_counts(spec) == [1, 8] and exchange_streams(spec) == 8
    res = plan(spec, _sweep_links([[1, 8.0], [8, 44.0]]), {"source": "bench", "per_site": {"a": 0.01, "b": 0.02}})
    assert (res.streams, res.streams_derived, res.link_pace, res.pace_derived) == (8, False, paced, False)
    # gloo: one connection per process, probed as such
    spec = load_spec(_spec_file(tmp_path, GLOO_SPEC))
    assert probe_counts(spec) == [1] and transport_model(spec, [])[0] == GLOO


def test_local_sites_are_modelled_as_clear_loopback_streams(tmp_path):
    # the default: sites on this host leave TLS after the hello, one stream each way, the plain copy's CPU
    spec = load_spec(_spec_file(tmp_path, SPEC.replace("transport_loopback_clear = false", "")))
    t, derived, paced = transport_model(spec, _sweep_links([[1, 8000.0], [8, 9000.0]]), 16 << 20)
    assert (t.kind, t.streams, t.pace_mbit, t.cpu_s_per_gb, derived, paced) == (
        "tls", 1, 0.0, CLEAR_CPU_S_PER_GB, False, False)
    spec = load_spec(_spec_file(tmp_path))  # kept encrypted: the TLS model
    assert transport_model(spec, [])[0].cpu_s_per_gb == TLS_CPU_S_PER_GB


def test_each_link_is_paced_at_its_own_rate_where_a_round_moves_several_bdps_over_it():
    window = [[1, 8.0], [2, 15.9], [4, 31.0], [8, 44.0], [16, 41.0]]  # 44 Mbit/s x 80 ms: 440 kB in flight
    big = 16 << 20
    both = {"a->b": 45.3, "b->a": 45.3}
    assert derive_link_pace(_sweep_links(window), big) == both
    assert derive_link_pace(_sweep_links(window), 4 * 440_000) == both  # PACE_MIN_BDPS of them
    assert derive_link_pace(_sweep_links(window), 4 * 440_000 - 1) == {}  # less: the windows hold it, unpaced
    half = round(1.03 * 44.0 / 2, 1)
    assert derive_link_pace(_sweep_links(window), big, reps=2) == {"a->b": half, "b->a": half}  # 2 processes
    # one stream fills a plain link, and a loss-based one still probes past its queue: paced too
    assert derive_link_pace(_sweep_links([[1, 19.5], [2, 19.6]], rtt=40.0), 500_996) == {"a->b": 20.2, "b->a": 20.2}
    # links of different rates each get their own; a long one that the round does not fill stays unpaced
    slow = [Link(src="a", dst="c", src_host="local", dst_host="local", mbit=19.6, rtt_ms=40.0, sweep=[[1, 19.6]])]
    long = [Link(src="c", dst="a", src_host="local", dst_host="local", mbit=98.0, rtt_ms=120.0, sweep=[[1, 98.0]])]
    assert derive_link_pace(slow + long + _sweep_links(window), 2_000_000) == {"a->c": 20.2, "a->b": 45.3,
                                                                                   "b->a": 45.3}
    unswept = Link(src="a", dst="c", src_host="local", dst_host="local", mbit=44.0, rtt_ms=80.0)
    assert derive_link_pace([unswept], big) == {}  # a link not swept: its rate unknown
    assert derive_link_pace([], big) == {}


def test_the_model_sends_each_link_at_its_own_pace():
    # 8 streams, a 2 MiB all-reduce of two members (each sends 2 MiB): a -> b paced at 16 Mbit/s in all
    net = {k: Path_(mbit=48.0, rtt_ms=10.0) for k in _net(48, 10, ["a", "b"])}
    t = Transport(kind="tls", streams=8)
    fast = tls_collective_s("sum", 2 << 20, ["a", "b"], net, 1, t)
    net[("a", "b")] = Path_(mbit=48.0, rtt_ms=10.0, pace_mbit=16.0)
    slow = tls_collective_s("sum", 2 << 20, ["a", "b"], net, 1, t)
    assert slow == pytest.approx((2 << 20) * 8 / 16e6, rel=0.05) and slow > 2.5 * fast
    # a link's own 0 leaves it unpaced under a transport-wide pace
    uniform = Transport(kind="tls", streams=8, pace_mbit=16.0)
    net = {k: Path_(mbit=48.0, rtt_ms=10.0, pace_mbit=0.0) for k in _net(48, 10, ["a", "b"])}
    assert tls_collective_s("sum", 2 << 20, ["a", "b"], net, 1, uniform) == pytest.approx(fast)
    # net_of puts a transport's per-link pace on its link
    links = _sweep_links([[1, 48.0]], rtt=10.0)
    got = net_of(links, 8, Transport(kind="tls", streams=8, link_pace={"a->b": 16.0}))
    assert (got[("a", "b")].pace_mbit, got[("b", "a")].pace_mbit) == (16.0, None)


def test_a_run_is_replayed_with_the_streams_and_pacing_it_ran_with(tmp_path):
    # a spec that sets neither: tune-h derives both, but a run of it (not written back) used the defaults
    window = [[1, 8.0], [2, 15.9], [4, 31.0], [8, 44.0], [16, 41.0]]
    spec = load_spec(_spec_file(tmp_path))
    derived, _, _ = transport_model(spec, _sweep_links(window, rtt=10.0), 16 << 20)
    ran, was_derived, paced = transport_model(spec, _sweep_links(window, rtt=10.0), 16 << 20, derive=False)
    assert (derived.streams, derived.link_pace) == (8, {"a->b": 45.3, "b->a": 45.3})
    assert (ran.streams, ran.link_pace, was_derived, paced) == (spec.diloco.transport_streams, {}, False, False)


def test_a_spec_that_sets_pacing_keeps_it_even_at_zero(tmp_path):
    window = [[1, 8.0], [2, 15.9], [4, 31.0], [8, 44.0], [16, 41.0]]
    p = _spec_file(tmp_path)
    p.write_text(p.read_text().replace("[diloco]\n", "[diloco]\ntransport_pace_mbit = 0.0\n", 1))
    res = plan(load_spec(p), _sweep_links(window, rtt=10.0), {"source": "bench", "per_site": {"a": 0.01, "b": 0.02}})
    assert (res.streams, res.streams_derived, res.pace_mbit, res.link_pace, res.pace_derived) == (8, True, 0.0, {}, False)
    # a per-link table in the spec is kept as it is, and modelled
    p.write_text(p.read_text().replace("transport_pace_mbit = 0.0\n", "transport_link_pace_mbit = {\"a->b\" = 30.0}\n"))
    res = plan(load_spec(p), _sweep_links(window, rtt=10.0), {"source": "bench", "per_site": {"a": 0.01, "b": 0.02}})
    assert (res.link_pace, res.pace_derived) == ({"a->b": 30.0}, False)


def test_a_short_idle_leaves_part_of_the_window():
    # 50 Mbit/s, 80 ms: a 500 kB window; RTO 0.28 s; each RTO idled halves it, down to 10 segments
    p = Path_(mbit=50, rtt_ms=80, restarts_idle=True)
    bdp = 500_000
    assert [restart_window(p, bdp, idle) for idle in (0.1, 0.3, 0.6, 1.0)] == [bdp, bdp / 2, bdp / 4, bdp / 8]
    assert restart_window(p, bdp, 30.0) == restart_window(p, bdp) == 14_480
    # from a quarter of the window, 500 kB: 2 round trips of doubling, the rest at the rate
    assert cold_send_s(500_000, p, idle_s=0.6) == pytest.approx(0.16 + 125_000 * 8 / 50e6)
    assert cold_send_s(500_000, p, idle_s=0.1) == pytest.approx(500_000 * 8 / 50e6)
    # choose sizes H for a full restart, then predicts the round at that H's compute
    net = {k: Path_(mbit=50, rtt_ms=80, restarts_idle=True) for k in _net(50, 80, ["a", "b"])}
    ph = [("sum", 500_000)]
    c = choose(mode="sync", sites=["a", "b"], net=net, step_by_site={"a": 0.0001, "b": 0.0001}, ph=ph,
               lighthouse_site="a", budget=0.5)
    worst = sync_round(ph, ["a", "b"], net, lighthouse_site="a")
    assert c.h == min_h(worst["sync_s"], 0.0001, 0.5)
    assert c.sync_s == pytest.approx(sync_round(ph, ["a", "b"], net, lighthouse_site="a", idle_s=c.h * 0.0001)["sync_s"])
    assert c.sync_s < worst["sync_s"]  # 1.1 s of compute: 3 RTOs, an eighth of the window kept


@pytest.mark.parametrize(("extra", "rounds", "raise_"), [
    ("[diloco]\nrounds = 4", 4, "diloco.rounds"),
    ("[train]\nsteps = 2000", None, "train.steps"),
])
def test_tune_h_notes_a_run_left_with_too_few_rounds_at_its_h(tmp_path, capsys, extra, rounds, raise_):
    from dilococtl.cli.tune import _show

    text = GLOO_SPEC.replace("[diloco]\nh = 5", extra.replace("[diloco]", "[diloco]\nh = 5")) \
        if extra.startswith("[diloco]") else GLOO_SPEC + "\n" + extra + "\n"
    spec = load_spec(_spec_file(tmp_path, text))
    res = plan(spec, _links(10, 40), {"source": "bench", "per_site": {"a": 0.01, "b": 0.02}}, budget=0.1)
    h = res.choice.h
    want = rounds if rounds is not None else 2000 // h
    assert res.rounds == want == rounds_at(spec, h) and res.to_json()["rounds"] == want
    assert want < FEW_ROUNDS
    _show(res)
    out = " ".join(capsys.readouterr().out.split())
    assert f"note: at H = {h} the run has {want} outer round(s)" in out and f"raise {raise_}" in out


def test_tune_h_says_nothing_of_rounds_when_there_are_enough(tmp_path, capsys):
    from dilococtl.cli.tune import _show

    spec = load_spec(_spec_file(tmp_path, GLOO_SPEC.replace("h = 5", "h = 5\nrounds = 40")))
    res = plan(spec, _links(10, 40), {"source": "bench", "per_site": {"a": 0.01, "b": 0.02}}, budget=0.1)
    assert res.rounds == 40
    _show(res)
    assert "outer round(s)" not in capsys.readouterr().out


def test_each_site_arriving_last_waits_its_own_quorum_rpc_then_the_rows_still_on_their_way():
    # the asymmetric lab as tune-h probed it (ring a -> b -> c -> a; Lighthouse at a, b 40 ms from
    # it, c 80 ms; b-c 120 ms), and the parts of the rounds its run measured, per site arriving last
    # (BENCHMARKS.md, "The TLS transport's model": quorum / weight / payload)
    links = {("a", "b"): (19.13, 40.46), ("b", "a"): (19.24, 40.46), ("a", "c"): (47.82, 80.56),
             ("c", "a"): (47.82, 80.56), ("b", "c"): (95.64, 120.59), ("c", "b"): (95.64, 120.59)}
    net = {k: Path_(mbit=m, rtt_ms=r, stream_mbit=m) for k, (m, r) in links.items()}
    t = Transport(kind="tls", streams=1)
    per = tls_last_site([("sum", 500_996)], ["a", "b", "c"], net, t, lighthouse_site="a")
    measured = {"a": (0.002, 0.123, 0.273), "b": (0.044, 0.080, 0.320), "c": (0.084, 0.041, 0.345)}
    for s, parts in measured.items():
        got = (per[s]["quorum_s"], per[s]["weight_s"], per[s]["payload_s"])
        assert got == pytest.approx(parts, abs=0.010), (s, got)
    # its own request's round trip, nothing of the others' answers: those show in the all-gather
    assert [per[s]["quorum_s"] for s in "abc"] == pytest.approx([0.0, 0.04046, 0.08056])
    c = choose(mode="sync", sites=["a", "b", "c"], net=net, step_by_site={s: 0.01 for s in "abc"},
                          ph=[("sum", 500_996)], lighthouse_site="a", transport=t)
    assert c.last_site == pytest.approx({s: per[s]["sync_s"] for s in "abc"})
    assert c.sync_s == pytest.approx(max(c.last_site.values())) == pytest.approx(c.last_site["c"])
    assert c.breakdown["quorum_s"] == pytest.approx(per["c"]["quorum_s"])  # the breakdown: the longest one's
    # no Lighthouse among the sites (or one site): every site waits the same
    c = choose(mode="sync", sites=["b", "c"], net=net, step_by_site={s: 0.01 for s in "bc"},
                          ph=[("sum", 500_000)], lighthouse_site="a")
    assert c.last_site == {"b": c.sync_s, "c": c.sync_s}


def test_a_round_replayed_from_its_arrivals():
    # two sites 40 ms apart, the Lighthouse at a: b's request still on its way when a arrives
    # makes a wait for it; one that reached the Lighthouse long before does not
    net = {(x, y): Path_(mbit=10, rtt_ms=40) for x, y in (("a", "b"), ("b", "a"))}
    t = Transport(kind="tls", streams=1)
    ph = [("sum", 100_000)]
    clean = tls_arrivals(ph, ["a", "b"], net, t, {"a": 1.0, "b": 0.0}, lighthouse_site="a")
    tie = tls_arrivals(ph, ["a", "b"], net, t, {"a": 1.0, "b": 0.995}, lighthouse_site="a")
    assert clean["a"]["quorum_s"] == 0.0 and tie["a"]["quorum_s"] == pytest.approx(0.015)
    assert tie["a"]["sync_s"] == pytest.approx(clean["a"]["sync_s"] + 0.015)
    for r in (clean, tie):
        for s in "ab":
            assert r[s]["sync_s"] == pytest.approx(r[s]["quorum_s"] + r[s]["weight_s"] + r[s]["payload_s"])
    assert clean["b"]["sync_s"] == pytest.approx(clean["a"]["sync_s"] + 1.0, abs=0.03)  # b waited for a


def test_tune_h_shows_the_round_each_site_waits_when_it_arrives_last(tmp_path, capsys):
    from dilococtl.cli.tune import _show

    spec = load_spec(_spec_file(tmp_path, GLOO_SPEC))
    res = plan(spec, _links(10, 40), {"source": "bench", "per_site": {"a": 0.01, "b": 0.02}}, budget=0.1)
    last = res.choice.last_site
    assert last["b"] == pytest.approx(res.choice.sync_s) and last["a"] == pytest.approx(res.choice.sync_s - 0.020)
    _show(res)
    out = " ".join(capsys.readouterr().out.split())
    assert f"arrives last waits it (its quorum RPC to the Lighthouse): a {last['a']:.3f} s, b {last['b']:.3f} s" in out


def _probe_report(fwd_mbit, rev_mbit=47.5, rtt=80.4) -> dict:
    return {"rtt_ms": {"median": rtt}, "forward": {"mbit": fwd_mbit, "streams": 8},
            "reverse": {"mbit": rev_mbit, "streams": 8}}


def test_probe_figures_become_links():
    from dilococtl.spec_types import SiteSection

    a, b = SiteSection(name="a", hosts=["h1"]), SiteSection(name="b", hosts=["h2"])
    fwd, rev = probe_links(_probe_report(44.0), a, b, 4)
    assert (fwd.src, fwd.dst, fwd.mbit, fwd.rtt_ms, fwd.streams) == ("a", "b", 44.0, 80.4, 8)
    assert (rev.src, rev.dst, rev.mbit) == ("b", "a", 47.5)


@pytest.mark.parametrize(("report", "named"), [
    (_probe_report(float("nan")), "a -> b Mbit/s = nan"),
    (_probe_report(44.0, float("inf")), "b -> a Mbit/s = inf"),
    (_probe_report(-3.0), "a -> b Mbit/s = -3.0"),
    (_probe_report("fast"), "a -> b Mbit/s = 'fast'"),
    (_probe_report(44.0, rtt=float("nan")), "rtt_ms = nan"),
    (_probe_report(44.0, rtt=-1), "rtt_ms = -1"),
])
def test_a_probe_reporting_a_non_finite_or_negative_figure_is_refused(report, named):
    # a NaN sweep used to pass: S came out 1 and the pacing 8.2 Mbit/s on a 44 Mbit/s link
    from dilococtl.errors import DilocoError
    from dilococtl.spec_types import SiteSection

    a, b = SiteSection(name="a", hosts=["h1"]), SiteSection(name="b", hosts=["h2"])
    with pytest.raises(DilocoError, match="link a <-> b: the probe reported") as e:
        probe_links(report, a, b, 4)
    assert named in str(e.value) and "not a finite number >= 0" in str(e.value)


def test_rounds_against_model_replays_each_round_from_its_arrivals(tmp_path):
    import dataclasses

    p = _spec_file(tmp_path)
    spec = load_spec(p)
    res = plan(spec, _links(10, 40), {"source": "bench", "per_site": {"a": 0.01, "b": 0.01}}, budget=0.1)

    def line(site, rnd, t0, sync, parts=(0.01, 0.02, 0.2)):
        q, w, x = parts
        return json.dumps({"kind": "round", "site": site, "round": rnd, "step": rnd * 5, "h": 5, "compute_s": 1.0,
                           "sync_s": sync, "bytes_sent": 0, "bytes_recv": 0, "k_active": 2, "k_nominal": 2,
                           "outer_lr": 0.7, "committed": True, "t": t0 + sync + 1.0, "exchange_t": t0,
                           "quorum_s": q, "weight_s": w, "payload_s": x})

    with Store.open() as store:
        run = store.create_run(spec)
        assert rounds_against_model(store, run) is None  # no tune for the run's H yet
        store.add_tune(spec_path=str(p.resolve()), links=[dataclasses.asdict(x) for x in res.links], step_s=0.01,
                       payload_bytes=res.payload_bytes, h=spec.diloco.h, budget=0.1, prediction=res.prediction())
        # round 1: b arrives 0.5 s after a; round 2: a 5 ms after b, whose request is still on its way
        # to the Lighthouse (at a); round 3 was recorded before the parts were: not replayed
        old = json.loads(line("b", 3, 300.0, 0.4))
        del old["exchange_t"], old["quorum_s"]
        store.ingest(run.id, "a", "local", "m", 10, [line("a", 1, 100.0, 0.9), line("a", 2, 200.005, 0.33),
                                                     line("a", 3, 300.0, 0.5)])
        store.ingest(run.id, "b", "local", "m", 10, [line("b", 1, 100.5, 0.35), line("b", 2, 200.0, 0.36),
                                                     json.dumps(old)])
        # a site that writes what are not numbers: its rounds are left out, not replayed into NaN or a crash
        for rnd, bad in ((4, {"exchange_t": float("nan")}), (5, {"quorum_s": float("inf")}), (6, {"exchange_t": "x"})):
            for site in ("a", "b"):
                rec = {**json.loads(line(site, rnd, 100.0 * rnd, 0.4)), **(bad if site == "b" else {})}
                store.ingest(run.id, site, "local", "m", 10 + rnd, [json.dumps(rec)])
        got = rounds_against_model(store, run)
    assert [(g["round"], g["site"], g["sync_s"]) for g in got] == [(1, "b", 0.35), (2, "a", 0.33)]
    net = net_of(res.links, res.streams)
    t = Transport(kind="tls", streams=res.streams)
    for g, starts in zip(got, ({"a": 0.0, "b": 0.5}, {"a": 0.005, "b": 0.0}), strict=True):
        want = tls_arrivals(res.phases, ["a", "b"], net, t, starts, lighthouse_site="a")[g["site"]]
        assert g["predicted_s"] == pytest.approx(want["sync_s"], abs=1e-6)
        assert g["predicted"]["weight_s"] == pytest.approx(want["weight_s"], abs=1e-6)
        assert g["measured"] == {"quorum_s": 0.01, "weight_s": 0.02, "payload_s": 0.2}
    assert got[0]["predicted"]["quorum_s"] == pytest.approx(0.040)  # b's own round trip
    assert got[1]["predicted"]["quorum_s"] == pytest.approx(0.015)  # a waits for b's request in flight
    with Store.open() as store:
        assert [g["round"] for g in rounds_against_model(store, run, last=5)] == [2]  # rounds 2-6 only
        from dilococtl.report import write_report

        write_report(store, run.id, tmp_path / "report")
    text = (tmp_path / "report" / "summary.md").read_text()
    assert "## The exchange against tune-h's model" in text
    assert f"| 1 | b | 0.350 | {got[0]['predicted_s']:.3f} |" in text and "| 2 | a | 0.330 |" in text


# --- where overlap's and async's update lands ----------------------------------------------------

def test_the_update_lands_after_the_exchanges_whole_steps():
    # the 2-site lab: exchange 0.269 s, step 14.3 ms -> 18.8 steps -> 19 of 190
    assert outer_rule.land_for(0.269, 0.0143, 190) == pytest.approx(19 / 190)
    assert outer_rule.land_step(190, outer_rule.land_for(0.269, 0.0143, 190)) == 19
    assert outer_rule.land_for(0.3, 0.1, 100) == pytest.approx(0.03)  # exactly 3 steps, not 4
    assert outer_rule.land_for(0.0, 0.1, 100) == 0.01  # no exchange: still 1 step late
    assert outer_rule.land_for(50.0, 0.1, 100) == 1.0  # longer than the round: at its end, and waited for
    for bad in (math.nan, math.inf, -1.0):
        with pytest.raises(ValueError, match="exchange time"):
            outer_rule.land_for(bad, 0.1, 100)
        with pytest.raises(ValueError, match="step time"):
            outer_rule.land_for(0.1, bad, 100)
    with pytest.raises(ValueError, match="H must be"):
        outer_rule.land_for(0.1, 0.1, 0)


def test_a_derived_landing_sizes_h_as_sync_and_hides_the_whole_exchange():
    net = _net(50, 20, ["a", "b"])
    kw = dict(sites=["a", "b"], net=net, step_by_site={"a": 0.05, "b": 0.05}, ph=[("sum", 10_000_000)],
              lighthouse_site="a", budget=0.1)
    sync = choose(mode="sync", land=None, **kw)
    over = choose(mode="overlap", land=None, **kw)
    assert over.h == sync.h and over.sync_s == sync.sync_s
    assert over.efficiency == 1.0 and over.land <= 0.1
    assert over.land == outer_rule.land_for(sync.sync_s, 0.05, sync.h) == sync.land
    assert over.land * over.h * 0.05 >= over.sync_s  # the landing is after the exchange
    # a fixed landing of a tenth: H halves, and the budget bounds what sticks out past the landing
    fixed = choose(mode="overlap", land=0.1, **kw)
    assert fixed.h < over.h and fixed.land == 0.1 and fixed.efficiency < 1.0
    rows = table(over, "overlap", 10_000, land=None)
    assert all(r["efficiency"] == 1.0 or r["land"] == 1.0 for r in rows)
    assert [r["land"] for r in rows if r["h"] == over.h] == [over.land]


def test_async_lands_after_the_slowest_sites_push():
    net = _net(80, 20, ["a", "b"])
    net[("b", "a")] = Path_(mbit=8, rtt_ms=20)
    c = choose(mode="async", sites=["a", "b"], net=net, step_by_site={"a": 0.1, "b": 0.2},
               ph=[("gather", 1_000_000)], pull_bytes=4_000_000, lighthouse_site="a", budget=0.1, land=None)
    # b's push and pull take 1.42 s (test above): within 10% of b's compute at H = 80 (1.6 s)
    assert c.h == 80 and c.efficiency == 1.0
    assert c.land == pytest.approx(8 / 80)  # 1.42 s / 0.2 s = 7.1 -> 8 of b's steps; a's 1 step
    lands = lands_at(80, sites=["a", "b"], net=net, step_by_site={"a": 0.1, "b": 0.2},
                                ph=[("gather", 1_000_000)], pull_bytes=4_000_000, lighthouse_site="a")
    assert lands["async"] == c.land


def test_plan_predicts_each_hidden_modes_landing_unless_the_spec_sets_one(tmp_path):
    steps = {"source": "bench", "per_site": {"a": 0.01, "b": 0.02}}
    res = plan(load_spec(_spec_file(tmp_path, GLOO_SPEC)), _links(10, 40), steps, budget=0.1)
    assert set(res.lands) == {"overlap", "async"} and res.lands["overlap"] == res.choice.land
    assert res.prediction()["lands"] == res.lands
    over = plan(load_spec(_spec_file(tmp_path, GLOO_SPEC.replace("[diloco]", '[diloco]\nmode = "overlap"'))),
                     _links(10, 40), steps, budget=0.1)
    assert over.choice.h == res.choice.h and over.choice.efficiency == 1.0
    assert over.lands["overlap"] * over.choice.h * 0.02 >= over.choice.sync_s
    fixed = plan(load_spec(_spec_file(tmp_path, GLOO_SPEC.replace(
        "[diloco]", '[diloco]\nmode = "overlap"\noverlap_land = 0.05'))), _links(10, 40), steps, budget=0.1)
    assert fixed.lands == {} and fixed.choice.land == 0.05 and fixed.choice.h < over.choice.h


@pytest.mark.parametrize("lands", [{"overlap": math.nan}, {"overlap": 2.0}, {"overlap": 0}, {"overlap": "x"},
                                   {"overlap": True}, None, {}])
def test_a_tune_without_a_sound_landing_leaves_the_default(tmp_path, lands):
    spec = load_spec(_spec_file(tmp_path, SPEC.replace("[diloco]", '[diloco]\nmode = "overlap"')))
    with Store.open() as store:
        store.add_tune(spec_path=spec.path, links=[], step_s=0.1, payload_bytes=10, h=5, budget=0.1,
                       prediction={"lands": lands})
        assert tuned_land(store, spec) is None


def test_launch_takes_the_landing_of_the_newest_tune_for_the_spec_and_h(tmp_path):
    p = _spec_file(tmp_path, SPEC.replace("[diloco]", '[diloco]\nmode = "overlap"'))
    spec = load_spec(p)
    with Store.open() as store:
        assert tuned_land(store, spec) is None  # no tune: the trainer's UNTUNED_LAND
        old = store.add_tune(spec_path=str(p.resolve()), links=[], step_s=0.1, payload_bytes=10, h=5, budget=0.1,
                             prediction={"lands": {"overlap": 0.4, "async": 0.6}}, created=1.0)
        new = store.add_tune(spec_path=str(p.resolve()), links=[], step_s=0.1, payload_bytes=10, h=5, budget=0.1,
                             prediction={"lands": {"overlap": 0.2, "async": 0.6}}, created=2.0)
        store.add_tune(spec_path=str(p.resolve()), links=[], step_s=0.1, payload_bytes=10, h=50, budget=0.1,
                       prediction={"lands": {"overlap": 0.9}}, created=3.0)  # another H: not this spec's
        assert old.id != new.id and tuned_land(store, spec) == (0.2, new.id)
        async_spec = load_spec(_spec_file(tmp_path, SPEC.replace("[diloco]", '[diloco]\nmode = "async"')))
        assert tuned_land(store, async_spec) == (0.6, new.id)
        for other in ('mode = "sync"', 'mode = "overlap"\noverlap_land = 0.5'):  # nothing to land, or set
            assert tuned_land(store, load_spec(_spec_file(tmp_path, SPEC.replace(
                "[diloco]", f"[diloco]\n{other}")))) is None


def test_tune_h_shows_where_the_update_lands(tmp_path, capsys):
    from dilococtl.cli.tune import _show

    spec = load_spec(_spec_file(tmp_path, GLOO_SPEC.replace("[diloco]", '[diloco]\nmode = "overlap"')))
    res = plan(spec, _links(10, 40), {"source": "bench", "per_site": {"a": 0.01, "b": 0.02}}, budget=0.1)
    h = res.choice.h
    steps = {m: round(f * h) for m, f in res.lands.items()}
    assert steps["overlap"] == math.ceil(res.choice.sync_s / 0.02 - 1e-9)
    _show(res)
    out = " ".join(capsys.readouterr().out.split())
    assert (f"overlap and async land the update as soon as the exchange is done (launch applies it): "
            f"overlap {steps['overlap']} of {h} steps, async {steps['async']} of {h} steps into the next round") in out
    assert "lands at" in out and f"{res.choice.land * 100:.1f}%" in out  # the table's column
