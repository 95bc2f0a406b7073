import io
import math
from fractions import Fraction

import pytest
import torch

from trainer.codecs.compression import Compressor, NonFiniteDelta
from trainer.codecs.phase_exchange import wire_cost
from trainer.collectives import SoloComm, ThreadComm, run_sites
from trainer.rules.codec_spec import CodecOptions, payload_bytes, wire_plan

SPECS = ["none", "int8", "fp8", "fp4", "topk:0.05", "topk:0.05+int8", "topk:0.05+fp8", "topk:0.05+fp4",
         "powersgd:4", "powersgd:4+int8", "powersgd:4+fp8", "powersgd:4+fp4"]
# a matrix PowerSGD takes, one too small for it, a vector, a 3-D tensor, one above a top-k block
SHAPES = [(48, 40), (6, 5), (40,), (8, 4, 10), (70000,)]


class Counting:
    """A comm that records what is handed to it."""

    def __init__(self, inner):
        self.inner, self.size, self.rank, self.calls = inner, inner.size, inner.rank, []

    def allreduce_sum(self, t):
        self.calls.append(("sum", t.nbytes))
        self.inner.allreduce_sum(t)

    def allgather(self, t):
        self.calls.append(("gather", t.nbytes))
        return self.inner.allgather(t)

    def alltoall(self, t):
        self.calls.append(("alltoall", t.nbytes))
        return self.inner.alltoall(t)

    def abort(self):
        self.inner.abort()


def gen(seed):
    return torch.Generator().manual_seed(seed)


def heavy(n, seed, kind):
    g = gen(seed)
    if kind == "normal":
        return torch.randn(n, generator=g) * 1e-3
    if kind == "student":  # Student-t with 2 degrees of freedom: infinite variance
        z = torch.randn(n, generator=g)
        chi2 = (torch.randn(n, 2, generator=g) ** 2).sum(1)
        return z / torch.sqrt(chi2 / 2) * 1e-3
    u = torch.rand(n, generator=g)  # Cauchy, clipped so fp32 stays finite and meaningful
    return torch.tan(math.pi * (u - 0.5)).clamp(-1e4, 1e4) * 1e-3


def roundtrip(spec, x, **opts):
    comp = Compressor(spec, error_feedback=False, options=CodecOptions(**opts))
    out, _ = comp.average([x], SoloComm())
    return out[0]


def site_deltas(k, shapes, seed):
    g = gen(seed)
    return [[torch.randn(s, generator=g) for s in shapes] for _ in range(k)]


def requantized(spec):
    """Specs whose average is quantized again by the shard's owner ("qsum" phases)."""
    return wire_plan(spec, SHAPES).phases[0].op == "qsum"


def assert_average(out, want, spec):
    """`out` is `want` (the mean of what each site's contribution decodes to), or for a re-quantized
    spec that mean after one more pass through the quantizer, chunk by chunk."""
    if not requantized(spec):
        assert torch.allclose(out, want, rtol=1e-5, atol=1e-6)
        return
    int8, fp4 = spec.endswith("int8"), spec.endswith("fp4")
    if spec.startswith("powersgd"):  # P and Q are re-quantized, not the product
        rel = float(torch.linalg.norm(out - want) / torch.linalg.norm(want))
        assert rel < (2e-2 if int8 else 0.15 if fp4 else 1e-1), rel
        return
    w, o = want.reshape(-1), out.reshape(-1)
    chunk = min(1024, w.numel())
    pad = -w.numel() % chunk
    wp = torch.nn.functional.pad(w, (0, pad)).view(-1, chunk)
    err = torch.nn.functional.pad((o - w).abs(), (0, pad)).view(-1, chunk)
    amax = wp.abs().amax(1, keepdim=True)
    spacing = amax / 127 if int8 else e2m1_gap(wp.abs(), amax / 6) if fp4 else \
        torch.maximum(wp.abs() * 2**-3, amax / 448 * 2**-9)
    assert bool((err <= spacing / 2 * (1 + 1e-4) + 1e-7).all())
    assert float(err.max()) > 0  # it was quantized again


def e2m1_gap(a, scale):
    """The gap between the two e2m1 values around a / scale, times scale (0, 0.5, 1, 1.5, 2, 3, 4, 6)."""
    y = a / scale
    return scale * torch.where(y < 2, 0.5, torch.where(y < 4, 1.0, 2.0))


def expected_mean(spec, owns, weights=None):
    """The average the group must return from each site's own decoded contribution: the weighted
    mean, or for top-k the weighted mean over the sites that sent a (nonzero) value there."""
    weights = weights or [1.0] * len(owns)
    acc = sum(w * o.reshape(-1) for w, o in zip(weights, owns, strict=True))
    if not spec.startswith("topk"):
        return acc / sum(weights)
    count = sum(w * (o.reshape(-1) != 0).float() for w, o in zip(weights, owns, strict=True))
    return torch.where(count > 0, acc / count.clamp(min=1e-30), 0.0)


def run_group(spec, deltas, weights=None, comps=None, **kw):
    k = len(deltas)
    comps = comps or [Compressor(spec, seed=7, **kw) for _ in range(k)]
    weights = weights or [1.0] * k
    comms = [Counting(c) for c in ThreadComm.group(k)]
    res = run_sites(comms, lambda r, c: comps[r].average(deltas[r], c, weights[r]))
    return [o for o, _ in res], [s for _, s in res], comps, comms


# --- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["normal", "student", "cauchy"])
@pytest.mark.parametrize("scale_dtype,slack", [("fp32", 1e-6), ("fp16", 2**-10), ("bf16", 2**-7)])
def test_int8_error_is_at_most_half_a_step_per_chunk(kind, scale_dtype, slack):
    x = heavy(5000, 1, kind) * (1e3 if scale_dtype == "fp16" else 1)  # fp16 scales: stay in its normal range
    dec = roundtrip("int8", x, chunk=256, scale_dtype=scale_dtype)
    pad = torch.nn.functional.pad
    step = pad(x, (0, 120)).view(-1, 256).abs().amax(1) / 127
    err = pad((dec - x).abs(), (0, 120)).view(-1, 256)
    assert bool((err <= (step * (1 + slack) / 2 + 1e-12)[:, None]).all())
    # the largest value of every chunk is represented (almost) exactly: nothing is clipped
    assert float(err.amax()) > 0 and float((dec - x).abs().max()) < float(step.max())


def test_int8_stochastic_rounding_is_unbiased():
    x = torch.linspace(-1, 1, 2048)
    step = 1 / 127
    comp = Compressor("int8", error_feedback=False, options=CodecOptions(stochastic=True))
    mean = sum(comp.average([x], SoloComm())[0][0] for _ in range(100)) / 100
    single = comp.average([x], SoloComm())[0][0]
    nearest = roundtrip("int8", x)
    assert float((single - x).abs().max()) <= step * (1 + 1e-5)
    assert float((single - x).abs().max()) > step / 2  # it does not round to nearest
    assert float((mean - x).abs().max()) < 0.25 * step
    assert float((nearest - x).abs().max()) > 0.45 * step  # nearest rounding keeps its bias


@pytest.mark.parametrize("kind", ["normal", "student", "cauchy"])
@pytest.mark.parametrize("stochastic", [False, True])
def test_fp8_error_is_within_e4m3_spacing(kind, stochastic):
    x = heavy(4096, 2, kind)
    dec = roundtrip("fp8", x, chunk=1024, stochastic=stochastic)
    scale = (x.view(-1, 1024).abs().amax(1) / 448)[:, None]
    ax = x.view(-1, 1024).abs()
    # e4m3: 3 mantissa bits (spacing 2^-3 relative), subnormal spacing 2^-9 of the scale
    spacing = torch.maximum(ax * 2**-3, scale * 2**-9)
    err = (dec - x).view(-1, 1024).abs()
    bound = spacing * (1.0 if stochastic else 0.5)
    assert bool((err <= bound * (1 + 1e-5) + 1e-12).all())
    assert torch.equal(torch.sign(dec[dec != 0]), torch.sign(x[dec != 0]))


@pytest.mark.parametrize("kind", ["normal", "cauchy"])
def test_topk_keeps_exactly_the_largest_values(kind):
    x = heavy(3000, 3, kind)
    dec = roundtrip("topk:0.01", x)
    kept = dec != 0
    assert int(kept.sum()) == 30
    assert torch.equal(dec[kept], x[kept])
    assert float(x[kept].abs().min()) >= float(x[~kept].abs().max())


@pytest.mark.parametrize(("block", "blocks", "k"), [(None, 49, 41), (65536, 4, 656)])
def test_topk_on_large_tensors_selects_per_block_with_int16_offsets(block, blocks, k):
    n = 200_000
    x = heavy(n, 4, "student")
    opts = {} if block is None else {"topk_block": block}
    size = block or CodecOptions().topk_block
    plan = wire_plan("topk:0.01", [(n,)], CodecOptions(**opts))
    r = plan.routes[0]
    assert (r.kind, r.block, r.blocks, r.k) == ("topk", size, blocks, k)
    assert plan.phases[0].field(0, "index").dtype == "i16"
    dec = roundtrip("topk:0.01", x, **opts)
    for b in range(blocks):
        xb, db = x[b * size:(b + 1) * size], dec[b * size:(b + 1) * size]
        kept = db != 0
        assert int(kept.sum()) == min(k, xb.numel())
        assert torch.equal(db[kept], xb[kept])
        assert float(xb[kept].abs().min()) >= float(xb[~kept].abs().max())


def test_topk_index_width_is_chosen_by_what_it_costs():
    # a tiny fraction: one global selection (2 entries, int32) beats a forced entry per block
    assert wire_plan("topk:0.00001", [(200_000,)]).phases[0].field(0, "index").dtype == "i32"
    # dense is sent when top-k would not save bytes
    assert wire_plan("topk:0.9", [(100,)]).routes[0].kind == "dense"
    assert payload_bytes("topk:0.9", [(100,)]) == 4 + 400


def test_topk_int8_quantizes_the_kept_values():
    x = heavy(3000, 5, "cauchy")
    exact = roundtrip("topk:0.01", x)
    dec = roundtrip("topk:0.01+int8", x)
    assert torch.equal(dec != 0, exact != 0) or int((dec != 0).sum()) < 30  # a tiny value may round to 0
    step = float(exact.abs().max()) / 127
    assert float((dec - exact).abs().max()) <= step / 2 * (1 + 1e-5)


def low_rank(rows, cols, rank, seed):
    g = gen(seed)
    return torch.randn(rows, rank, generator=g) @ torch.randn(rank, cols, generator=g)


def test_powersgd_warm_start_converges_to_the_best_rank_r_approximation():
    g = gen(6)
    u, _ = torch.linalg.qr(torch.randn(64, 64, generator=g))
    v, _ = torch.linalg.qr(torch.randn(48, 48, generator=g))
    s = 0.6 ** torch.arange(48, dtype=torch.float32)
    m = u[:, :48] @ torch.diag(s) @ v.t()
    best = float(torch.linalg.norm(m - u[:, :4] @ torch.diag(s[:4]) @ v[:, :4].t()))
    comp = Compressor("powersgd:4", error_feedback=False, seed=1)
    errs = [float(torch.linalg.norm(comp.average([m], SoloComm())[0][0] - m)) for _ in range(8)]
    assert errs[-1] <= best * 1.001
    assert errs[0] > errs[-1] * 1.01  # the warm start is what gets it there


def test_powersgd_is_exact_for_rank_deficient_inputs_across_sites():
    g = gen(8)
    basis = torch.randn(64, 3, generator=g)  # every site's delta lives in the same 3-dim column space
    comps = [Compressor("powersgd:4", error_feedback=False, seed=3) for _ in range(3)]
    for _ in range(4):
        deltas = [[basis @ torch.randn(3, 48, generator=g)] for _ in range(3)]  # new rows every round
        outs, _, _, _ = run_group("powersgd:4", deltas, comps=comps)
        want = sum(d[0] for d in deltas) / 3
        assert float(torch.linalg.norm(outs[0][0] - want) / torch.linalg.norm(want)) < 1e-5
    # a full-rank input is not reproduced: the check above can fail
    deltas = [[torch.randn(64, 48, generator=g)] for _ in range(3)]
    outs, _, _, _ = run_group("powersgd:4", deltas, comps=comps)
    want = sum(d[0] for d in deltas) / 3
    assert float(torch.linalg.norm(outs[0][0] - want) / torch.linalg.norm(want)) > 0.5


def test_powersgd_int8_on_a_rank_deficient_input_errs_like_int8():
    g = gen(8)
    basis = torch.randn(64, 3, generator=g)
    deltas = [[basis @ torch.randn(3, 48, generator=g)] for _ in range(3)]
    comps = [Compressor("powersgd:4+int8", error_feedback=False, seed=3) for _ in range(3)]
    want = sum(d[0] for d in deltas) / 3
    for _ in range(4):
        outs, _, _, _ = run_group("powersgd:4+int8", deltas, comps=comps)
        # P and Q go column by column through int8: about 1% of the norm, not the rank-4 truncation
        assert float(torch.linalg.norm(outs[0][0] - want) / torch.linalg.norm(want)) < 1.5e-2


# --- bytes -----------------------------------------------------------------------------------


def test_payload_bytes_by_hand():
    shapes = [(3000,), (64, 64)]
    # weight (4) + values
    assert payload_bytes("none", shapes) == 4 + 4 * (3000 + 4096)
    # int8, chunks of 1024: 3 + 4 fp32 scales
    assert payload_bytes("int8", shapes) == 4 + (3000 + 3 * 4) + (4096 + 4 * 4)
    assert payload_bytes("fp8", shapes, CodecOptions(scale_dtype="fp16")) == 4 + (3000 + 3 * 2) + (4096 + 4 * 2)
    # top-k: 30 and 41 entries, int16 offsets (one block each), fp32 values
    assert payload_bytes("topk:0.01", shapes) == 4 + 30 * 6 + 41 * 6
    # PowerSGD rank 8: P 64x8 and Q 64x8 for the matrix, the vector sent plain
    assert payload_bytes("powersgd:8", shapes) == 4 + 4 * 3000 + 4 * 512 + 4 * 512
    # ... and with int8: P and Q are quantized column by column, one scale per 64-value column
    assert payload_bytes("powersgd:8+int8", shapes) == 4 + (3000 + 12) + (512 + 8 * 4) + (512 + 8 * 4)
    # rank 16: 64*64 = 2 * 16 * (64+64), still a gain of 2; rank 17 is not: the plain path
    assert wire_plan("powersgd:16", shapes).routes[1].kind == "powersgd"
    assert wire_plan("powersgd:17", shapes).routes[1].kind == "dense"
    assert wire_plan("powersgd:17", shapes, CodecOptions(powersgd_min_gain=1.0)).routes[1].kind == "powersgd"


@pytest.mark.parametrize("spec", SPECS)
def test_payload_bytes_is_what_the_exchange_hands_to_the_comm(spec):
    deltas = site_deltas(3, SHAPES, 9)
    _, stats, _, comms = run_group(spec, deltas)
    want = payload_bytes(spec, SHAPES)
    phases = 2 if spec.startswith("powersgd") else 1
    for comm, st in zip(comms, stats, strict=True):
        assert st.payload == want and st.dense == 4 * sum(math.prod(s) for s in SHAPES)
        assert st.collectives == len(comm.calls)
        if requantized(spec):
            # per phase: an all-to-all of 3 shard messages, then an all-gather of the averaged shard;
            # the shards cut the payload in 3 within a chunk (1024 codes + scale) plus a 4-byte header
            assert [op for op, _ in comm.calls] == ["alltoall", "gather"] * phases
            msgs = [n for op, n in comm.calls if op == "gather"]
            assert [n for op, n in comm.calls if op == "alltoall"] == [3 * m for m in msgs]
            assert want - 4 <= 3 * sum(msgs) <= want + phases * 3 * (4 + 1028 + 3)
            assert st.bytes_sent == st.bytes_recv == sum(2 * 2 * m for m in msgs)  # (K-1) messages, twice
            continue
        assert sum(n for _, n in comm.calls) == want
        assert len(comm.calls) == phases
        counted = sum(Fraction(4 * n, 3) if op == "sum" else 2 * n for op, n in comm.calls)
        assert st.bytes_sent == st.bytes_recv == math.floor(counted)
    ops = {op for op, _ in comms[0].calls}
    assert ops == ({"sum"} if spec in ("none", "powersgd:4") else
                   {"gather"} if spec.startswith("topk") else {"alltoall", "gather"})
    if spec not in ("none", "powersgd:4"):  # PowerSGD alone sends the 70000-vector in fp32
        assert want < payload_bytes("none", SHAPES) / 2


def test_qsum_sends_a_quarter_of_what_fp32_sends():
    """int8 crosses the wire as an fp32 ring all-reduce would, at a quarter of the bytes."""
    shapes = [(256, 256), (256,)] * 4
    deltas = site_deltas(4, shapes, 17)
    _, fp32, _, _ = run_group("none", deltas)
    _, q, _, _ = run_group("int8", deltas)
    ratio = q[0].bytes_sent / fp32[0].bytes_sent
    assert 0.25 < ratio < 0.252, ratio  # codes + one fp32 scale per 1024 + shard headers


@pytest.mark.parametrize("opts", [dict(chunk=256, scale_dtype="fp16"), dict(chunk=100, scale_dtype="bf16", stochastic=True)])
@pytest.mark.parametrize("spec", ["int8", "fp8", "powersgd:4+int8"])
def test_qsum_with_codec_options_agrees_everywhere_and_tracks_the_mean(spec, opts):
    deltas = site_deltas(3, SHAPES, 18)
    comps = [Compressor(spec, seed=7, site=i, options=CodecOptions(**opts)) for i in range(3)]
    outs, stats, _, _ = run_group(spec, deltas, comps=comps)
    for i in range(len(SHAPES)):
        assert all(torch.equal(o[i], outs[0][i]) for o in outs[1:])
        want = sum(d[i] for d in deltas) / 3
        rel = float(torch.linalg.norm(outs[0][i] - want) / torch.linalg.norm(want))
        assert rel < (0.1 if spec == "fp8" else 0.03 if spec == "int8" else 1.0), (i, rel)
    assert stats[0].bytes_sent < 0.3 * 4 / 3 * 4 * sum(math.prod(sh) for sh in SHAPES)  # ~1/4 of an fp32 ring


def test_wire_cost_formulas():
    assert wire_cost("sum", 900, 3) == 1200  # a ring: 2 (K-1)/K n
    assert wire_cost("gather", 900, 3) == 1800  # (K-1) n
    assert wire_cost("sum", 900, 1) == wire_cost("gather", 900, 1) == 0.0


# --- averaging -------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
def test_average_is_the_mean_of_each_sites_own_decoded_contribution(spec):
    deltas = site_deltas(3, SHAPES, 10)
    outs, _, comps, _ = run_group(spec, deltas)
    for i, shape in enumerate(SHAPES):
        for o in outs[1:]:
            assert torch.equal(o[i], outs[0][i])  # every site gets the same bits
        # with error feedback, own decoded contribution = delta - new residual
        res = [c.state_dict()["residuals"].get(str(i)) for c in comps]
        own = [deltas[k][i].reshape(-1) - (res[k] if res[k] is not None else 0) for k in range(3)]
        want = expected_mean(spec, own).view(shape)
        assert_average(outs[0][i], want, spec)
        assert outs[0][i].dtype == torch.float32 and tuple(outs[0][i].shape) == shape


@pytest.mark.parametrize("spec", ["int8", "fp8", "topk:0.05", "topk:0.05+int8"])
def test_quantized_average_equals_mean_of_single_site_round_trips(spec):
    deltas = site_deltas(3, SHAPES, 11)
    outs, _, _, _ = run_group(spec, deltas)
    for i in range(len(SHAPES)):
        solo = [roundtrip(spec, deltas[k][i]) for k in range(3)]
        assert_average(outs[2][i], expected_mean(spec, solo).view(SHAPES[i]), spec)


@pytest.mark.parametrize("spec", SPECS)
def test_weight_zero_site_is_excluded_but_takes_part(spec):
    deltas = site_deltas(3, SHAPES, 12)
    deltas[2] = [torch.full(s, float("nan")) for s in SHAPES]  # a healed site's delta is meaningless
    outs3, stats3, comps3, _ = run_group(spec, deltas, weights=[1.0, 1.0, 0.0])
    outs2, stats2, comps2, _ = run_group(spec, deltas[:2])
    for i in range(len(SHAPES)):
        assert torch.equal(outs3[2][i], outs3[0][i])
        if requantized(spec):  # 3 shards vs 2: the second quantization cuts other chunks
            rel = float(torch.linalg.norm(outs3[0][i] - outs2[0][i]) / torch.linalg.norm(outs2[0][i]))
            assert rel < (2e-2 if spec.endswith("int8") else 1e-1)
        else:
            assert torch.allclose(outs3[0][i], outs2[0][i], rtol=1e-5, atol=1e-6)
    assert stats3[2].payload == stats3[0].payload == stats2[0].payload
    assert all(float(e.abs().max()) == 0 for e in comps3[2].state_dict()["residuals"].values())
    for q2, q0 in zip(comps3[2].global_state()["q"].values(), comps3[0].global_state()["q"].values(), strict=True):
        assert torch.equal(q2, q0)  # the warm start stays equal at every site


@pytest.mark.parametrize("spec", ["none", "int8", "topk:0.05+fp8", "powersgd:4", "powersgd:4+int8"])
def test_fractional_weights_give_the_weighted_mean_of_decoded_contributions(spec):
    weights = [1.0, 0.5, 0.25]
    deltas = site_deltas(3, SHAPES, 16)
    outs, _, comps, _ = run_group(spec, deltas, weights=weights)
    for i, shape in enumerate(SHAPES):
        res = [c.state_dict()["residuals"].get(str(i)) for c in comps]
        own = [deltas[k][i].reshape(-1) - (res[k] if res[k] is not None else 0) for k in range(3)]
        want = expected_mean(spec, own, weights).view(shape)
        assert_average(outs[1][i], want, spec)


def test_all_sites_weight_zero_is_an_error():
    deltas = site_deltas(2, [(10,)], 13)
    with pytest.raises(ValueError, match="no participating site"):
        run_group("int8", deltas, weights=[0.0, 0.0])


# --- error feedback --------------------------------------------------------------------------


def drift(spec, ef, rounds, shapes, sites=2):
    """|| sum of averaged outputs - sum of mean inputs || after each of `rounds`."""
    comps = [Compressor(spec, error_feedback=ef, seed=0) for _ in range(sites)]
    g = gen(14)
    data = [[[torch.randn(s, generator=g) for s in shapes] for _ in range(sites)] for _ in range(max(rounds))]

    def site(rank, comm):
        gap = [torch.zeros(s) for s in shapes]
        out = {}
        for t in range(max(rounds)):
            avg, _ = comps[rank].average(data[t][rank], comm)
            for i in range(len(shapes)):
                gap[i] += avg[i] - sum(d[i] for d in data[t]) / sites
            if t + 1 in rounds:
                out[t + 1] = math.sqrt(sum(float((x**2).sum()) for x in gap))
        return out

    return run_sites(ThreadComm.group(sites), site)[0]


@pytest.mark.parametrize("spec", ["int8", "fp8", "topk:0.05", "topk:0.05+int8", "powersgd:2", "powersgd:4+int8"])
def test_error_feedback_keeps_the_running_sum_within_a_fixed_bound(spec):
    """Classic error feedback (decay 1). Top-k's senders' mean is not a mean of the inputs, so
    for top-k this is each site's codec alone: its sent values track its inputs."""
    shapes = [(32, 32), (40,)] if not spec.startswith("powersgd") else [(32, 32)]
    sites = 1 if spec.startswith("topk") else 2
    with_ef = drift(spec, True, (20, 200), shapes, sites)
    without = drift(spec, False, (20, 200), shapes, sites)
    assert with_ef[200] < 1.3 * with_ef[20]
    assert without[200] > 2 * without[20]  # without it, the errors pile up (~sqrt(rounds))
    assert with_ef[200] < without[200] / 2


def test_error_feedback_residual_is_what_the_round_lost():
    x = heavy(3000, 15, "normal")
    comp = Compressor("topk:0.01", error_feedback=True)
    out1, _ = comp.average([x], SoloComm())
    e = comp.state_dict()["residuals"]["0"]
    assert torch.equal(e + out1[0], x)
    out2, _ = comp.average([torch.zeros(3000)], SoloComm())
    # the next round sends the largest of what was left behind
    assert torch.equal(out2[0], roundtrip("topk:0.01", e))


def test_decayed_error_feedback_keeps_that_share_of_what_the_round_lost():
    x = heavy(3000, 15, "normal")
    comp = Compressor("topk:0.01", error_feedback=True, decay=0.5)
    out, _ = comp.average([x], SoloComm())
    assert torch.allclose(comp.state_dict()["residuals"]["0"], 0.5 * (x - out[0]))
    with pytest.raises(ValueError, match="decay must be in"):
        Compressor("int8", decay=1.5)


def test_topk_averages_each_coordinate_over_the_sites_that_sent_it():
    # 1% of 1000 = 10 values per site: site 0's ten are 0..9, site 1's 5..14; site 2 (weight 0) sends 20..29
    xs = [torch.zeros(1000) for _ in range(3)]
    xs[0][:10] = 4.0
    xs[1][5:15] = 2.0
    xs[2][20:30] = 100.0
    outs, _, comps, _ = run_group("topk:0.01", [[x] for x in xs], weights=[1.0, 1.0, 0.0])
    want = torch.zeros(1000)
    want[:5], want[5:10], want[10:15] = 4.0, 3.0, 2.0  # one sender: its value; two: their mean
    assert torch.equal(outs[0][0], want)
    # a residual keeps what its site did not send, whatever the others sent there
    xs[0][500] = 1.0  # the 11th largest: not sent
    outs, _, comps, _ = run_group("topk:0.01", [[x] for x in xs], weights=[1.0, 1.0, 0.0])
    assert torch.equal(outs[0][0], want)
    e0, e1, e2 = (c.state_dict()["residuals"]["0"] for c in comps)
    assert float(e0[500]) == 1.0 and int((e0 != 0).sum()) == 1
    assert float(e1.abs().max()) == 0
    assert float(e2.abs().max()) == 0  # weight 0: untouched


# --- state -----------------------------------------------------------------------------------


def checkpoint(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


@pytest.mark.parametrize("prepared", [True, False])
@pytest.mark.parametrize("spec", ["powersgd:4+int8", "topk:0.05+fp8"])
def test_state_round_trip_resumes_bit_for_bit(spec, prepared):
    comps = [Compressor(spec, seed=5) for _ in range(2)]
    for r in range(3):
        run_group(spec, site_deltas(2, SHAPES, 20 + r), comps=comps)
    saved = [(checkpoint(c.state_dict()), checkpoint(c.global_state())) for c in comps]
    fresh = [Compressor(spec, seed=5) for _ in range(2)]
    for f, (sd, gs) in zip(fresh, saved, strict=True):
        if prepared:  # else loaded before the first round plans the wire: kept, not reset
            f.prepare(SHAPES)
        f.load_state_dict(sd)
        f.load_global_state(gs)
    nxt = site_deltas(2, SHAPES, 30)
    a, _, _, _ = run_group(spec, nxt, comps=comps)
    b, _, _, _ = run_group(spec, nxt, comps=fresh)
    for i in range(len(SHAPES)):
        assert torch.equal(a[0][i], b[0][i])
    assert any(float(e.abs().max()) > 0 for e in saved[0][0]["residuals"].values())


def test_healed_site_loads_q_from_a_peer_and_agrees():
    spec = "powersgd:4"
    comps = [Compressor(spec, seed=5) for _ in range(2)]
    for r in range(2):
        run_group(spec, site_deltas(2, SHAPES, 40 + r), comps=comps)
    healed = Compressor(spec, seed=5)
    healed.load_global_state(checkpoint(comps[0].global_state()))
    group = [comps[0], comps[1], healed]
    outs, _, _, _ = run_group(spec, site_deltas(3, SHAPES, 50), weights=[1.0, 1.0, 0.0], comps=group)
    for i in range(len(SHAPES)):
        assert torch.equal(outs[2][i], outs[0][i])


def test_initial_q_is_equal_at_every_site_and_set_by_the_seed():
    a, b, c = (Compressor("powersgd:4", seed=s) for s in (1, 1, 2))
    for comp in (a, b, c):
        comp.prepare(SHAPES)
    qa, qb, qc = (comp.global_state()["q"]["0"] for comp in (a, b, c))
    assert torch.equal(qa, qb) and not torch.equal(qa, qc)
    assert tuple(qa.shape) == (40, 4)


def test_state_for_another_spec_or_other_shapes_is_refused():
    comp = Compressor("int8")
    comp.prepare([(10,)])
    with pytest.raises(ValueError, match="spec"):
        comp.load_state_dict(Compressor("fp8").state_dict())
    with pytest.raises(ValueError, match="does not fit"):
        comp.load_state_dict({"spec": "int8", "residuals": {"0": torch.zeros(11)}})
    with pytest.raises(ValueError, match="shapes must not change"):
        comp.average([torch.zeros(12)], SoloComm())
    early = Compressor("int8")  # loaded before any round: checked when the shapes are known
    early.load_state_dict({"spec": "int8", "residuals": {"0": torch.zeros(11)}})
    with pytest.raises(ValueError, match="does not fit"):
        early.average([torch.zeros(10)], SoloComm())


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_delta_raises_before_anything_is_sent(bad):
    x = [torch.zeros(5), torch.ones(3, 4)]
    x[1][2, 1] = bad
    comm = Counting(SoloComm())
    comp = Compressor("int8")
    with pytest.raises(NonFiniteDelta, match="parameter 1") as info:
        comp.average(x, comm)
    assert info.value.index == 1 and isinstance(info.value, ValueError)
    assert comm.calls == []
    assert all(float(e.abs().max()) == 0 for e in comp.state_dict()["residuals"].values())


def test_huge_finite_values_are_not_mistaken_for_inf():
    x = torch.full((4,), 3e38)  # their sum overflows; the values do not
    out, _ = Compressor("none").average([x], SoloComm())
    assert torch.equal(out[0], x)


def test_bad_spec_weight_and_options_are_refused():
    with pytest.raises(ValueError, match="unknown codec 'int4'"):
        Compressor("int4")
    with pytest.raises(ValueError, match="scale_dtype"):
        Compressor("int8", options=CodecOptions(scale_dtype="fp64"))
    with pytest.raises(ValueError, match="weight"):
        Compressor("int8").average([torch.zeros(3)], SoloComm(), weight=-1.0)


@pytest.mark.parametrize(("opts", "name"), [({"chunk": 0}, "chunk"), ({"scale_dtype": "fp64"}, "scale_dtype"),
                                            ({"topk_block": 0}, "topk_block"), ({"topk_block": 65537}, "topk_block")])
def test_bad_codec_options_fail_naming_the_option(opts, name):
    with pytest.raises(ValueError, match=f"codec {name} must"):
        Compressor("topk:0.01", options=CodecOptions(**opts))


def test_joined_is_a_view_only_where_the_parts_lie_end_to_end():
    from trainer.codecs.phase_exchange import joined

    base = torch.arange(10, dtype=torch.float32)
    view = joined([base[0:3], base[3:7], base[7:10]])
    assert torch.equal(view, base) and view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    view[0] = 99.0  # shares the buffer: nothing was copied
    assert base[0] == 99.0
    for parts in ([base[0:3], base[4:7]],  # a gap
                  [base[3:5], base[0:3]],  # out of order
                  [base[0:3], torch.arange(3, dtype=torch.float32)],  # another storage
                  [base[0:4], base[4:8].double()],  # another dtype
                  [base[0:6:2], base[6:8]]):  # not contiguous
        got = joined(parts)
        assert torch.equal(got, torch.cat(parts)) and got.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
