"""fp4 (e2m1, per-chunk scales, two codes a byte): codes, packing, bytes, averaging, state."""

import math

import pytest
import torch

from tests.unit.test_compression import (
    Counting,
    checkpoint,
    e2m1_gap,
    gen,
    heavy,
    roundtrip,
    run_group,
    site_deltas,
)
from trainer.codecs.compression import Compressor
from trainer.codecs.quantize import pack, unpack
from trainer.collectives import SoloComm, ThreadComm, run_sites
from trainer.rules.codec_spec import CodecOptions, parse_codec_spec, payload_bytes, wire_plan

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def wire_bytes(spec, xs, **opts):
    """(decoded, the uint8 buffers handed to the comm) of one solo round of `xs`."""
    comm = Captured(SoloComm())
    out, _ = Compressor(spec, error_feedback=False, options=CodecOptions(**opts)).average(xs, comm)
    return out, comm.sent


class Captured(Counting):
    def __init__(self, inner):
        super().__init__(inner)
        self.sent = []

    def allgather(self, t):
        self.sent.append(t.clone())
        return super().allgather(t)


def chunked(x, chunk):
    pad = -x.numel() % chunk
    return torch.nn.functional.pad(x, (0, pad)).view(-1, chunk), pad


# --- codes -----------------------------------------------------------------------------------


def test_every_e2m1_value_has_its_bit_pattern_and_round_trips_exactly():
    vals = torch.tensor([s * m for s in (1.0, -1.0) for m in E2M1])  # codes 0-15 in order (8 is -0)
    dec, sent = wire_bytes("fp4", [vals * 0.25])  # scale 6 * 0.25 / 6 = 0.25: every value exact
    assert torch.equal(dec[0], vals * 0.25)
    # weight (4 bytes), one fp32 scale, then 8 bytes: code 2i in the low half, 2i+1 in the high one
    codes = sent[0][8:16]
    want = [(2 * i) | ((2 * i + 1) << 4) for i in range(8)]
    want[4] = 0x90  # -0 is sent as +0 (same value)
    assert codes.tolist() == want
    assert sent[0][4:8].view(torch.float32).item() == 0.25


@pytest.mark.parametrize("kind", ["normal", "student", "cauchy"])
def test_nearest_error_is_within_half_the_e2m1_spacing_times_the_scale(kind):
    x = heavy(4096, 2, kind)
    dec = roundtrip("fp4", x, chunk=512)
    xs, _ = chunked(x, 512)
    scale = xs.abs().amax(1, keepdim=True) / 6
    err = (dec - x).view(-1, 512).abs()
    assert bool((err <= e2m1_gap(xs.abs(), scale) / 2 * (1 + 1e-5) + 1e-12).all())
    assert float(err.max()) > 0.2 * float(scale.min())  # it quantized something
    # a chunk's largest value is represented (up to the scale's rounding): nothing is clipped
    assert torch.allclose(dec.view(-1, 512).abs().amax(1, keepdim=True), xs.abs().amax(1, keepdim=True), rtol=1e-6)


def test_stochastic_rounding_is_unbiased_and_stays_on_the_neighbours():
    x = torch.linspace(-1, 1, 2048)  # one chunk, scale 1/6
    gap = e2m1_gap(x.abs(), torch.tensor(1 / 6))
    comp = Compressor("fp4", error_feedback=False, options=CodecOptions(stochastic=True, chunk=2048))
    draws = [comp.average([x], SoloComm())[0][0] for _ in range(300)]
    mean = sum(draws) / len(draws)
    assert all(bool(((d - x).abs() <= gap * (1 + 1e-5)).all()) for d in draws)
    assert float(((mean - x).abs() / gap).max()) < 0.25
    nearest = roundtrip("fp4", x, chunk=2048)
    assert float(((nearest - x).abs() / gap).max()) > 0.45  # nearest rounding keeps its bias


def test_all_zero_chunks_decode_to_zeros_without_nan():
    x = torch.zeros(3000)
    x[2048:2100] = torch.linspace(-3, 3, 52)  # chunks 0 and 1 all zero, chunk 2 not
    for spec, opts in (("fp4", {}), ("fp4", {"stochastic": True}), ("fp4", {"scale_dtype": "fp16"})):
        dec = roundtrip(spec, x, **opts)
        assert bool(torch.isfinite(dec).all()) and float(dec[:2048].abs().max()) == 0
    outs, _, _, _ = run_group("fp4", [[torch.zeros(3000)] for _ in range(3)])  # every shard zero
    assert all(float(o[0].abs().max()) == 0 and bool(torch.isfinite(o[0]).all()) for o in outs)


# --- packing ---------------------------------------------------------------------------------


def grid_values(n, chunk, seed):
    """Values that fp4 represents exactly: e2m1 grid points, each chunk holding a 6 (scale 1)."""
    g = gen(seed)
    v = torch.tensor(E2M1)[torch.randint(0, 8, (n,), generator=g)] * torch.where(torch.rand(n, generator=g) < 0.5, -1, 1)
    v[::chunk] = 6.0
    return v


@pytest.mark.parametrize(("n", "chunk"), [(1001, 1024), (1001, 7), (1024, 1024), (1, 1024), (3000, 999)])
def test_odd_runs_and_chunks_pack_every_chunk_from_a_fresh_byte(n, chunk):
    x = grid_values(n, chunk, n + chunk)
    dec, sent = wire_bytes("fp4", [x], chunk=chunk)
    assert torch.equal(dec[0], x)  # exact: a code misplaced by one half-byte would show
    lens = [min(chunk, n - i) for i in range(0, n, chunk)]
    codes = sum(-(-ln // 2) for ln in lens)
    assert sent[0].numel() == payload_bytes("fp4", [(n,)], CodecOptions(chunk=chunk)) == 4 + 4 * len(lens) + codes
    # each odd chunk leaves its last byte's high half empty
    q, pos = sent[0][4 + 4 * len(lens):], 0
    for ln in lens:
        pos += -(-ln // 2)
        if ln % 2:
            assert int(q[pos - 1]) >> 4 == 0


def test_pack_unpack_round_trip_over_chunks_of_mixed_lengths():
    lens = torch.tensor([1, 2, 3, 1024, 7, 0, 8, 5])
    codes = torch.randint(0, 16, (int(lens.sum()),), generator=gen(3), dtype=torch.uint8)
    packed = pack(codes, lens, "fp4")
    assert packed.numel() == sum(-(-int(n) // 2) for n in lens)
    assert torch.equal(unpack(packed, lens, "fp4"), codes)


def test_powersgd_sends_odd_length_columns_each_from_a_fresh_byte():
    g = gen(4)
    m = torch.randn(49, 4, generator=g) @ torch.randn(4, 41, generator=g)  # rank 4: PowerSGD itself is exact
    plan = wire_plan("powersgd:4+fp4", [(49, 41)])
    assert plan.routes[0].kind == "powersgd"
    p, q = plan.phases[0].field(0, "P.q"), plan.phases[1].field(0, "Q.q")
    assert (p.count, p.values, q.count, q.values) == (4 * 25, 4 * 49, 4 * 21, 4 * 41)
    assert plan.payload_bytes == 4 + (4 * 4 + 100) + (4 * 4 + 84)
    comm = Captured(SoloComm())
    comp = Compressor("powersgd:4+fp4", error_feedback=False)
    errs = [float(torch.linalg.norm(comp.average([m], comm)[0][0] - m) / torch.linalg.norm(m)) for _ in range(3)]
    assert errs[-1] < 0.2, errs  # fp4 error on P and Q, not scrambled columns
    for buf, f, col in ((comm.sent[-2], p, 25), (comm.sent[-1], q, 21)):
        codes = buf[f.offset:f.offset + f.count].view(4, col)
        assert bool((codes[:, -1] >> 4 == 0).all())  # a column's last byte: one code, the high half empty
    # three sites: P's and Q's odd columns averaged shard by shard, the same bits everywhere
    comps = [Compressor("powersgd:4+fp4", seed=2) for _ in range(3)]
    deltas = [[m * (1 + k)] for k in range(3)]
    for _ in range(3):
        outs, _, _, _ = run_group("powersgd:4+fp4", deltas, comps=comps)
    assert all(torch.equal(o[0], outs[0][0]) for o in outs[1:])
    assert float(torch.linalg.norm(outs[0][0] - 2 * m) / torch.linalg.norm(2 * m)) < 0.2


# --- bytes -----------------------------------------------------------------------------------


def test_payload_is_an_eighth_of_fp32_plus_scales():
    shapes = [(3000,), (64, 64)]
    assert payload_bytes("fp4", shapes) == 4 + (1500 + 3 * 4) + (2048 + 4 * 4)
    assert payload_bytes("fp4", shapes, CodecOptions(scale_dtype="bf16", chunk=100)) == 4 + (1500 + 30 * 2) + (2048 + 41 * 2)
    assert payload_bytes("topk:0.01+fp4", shapes) == 4 + (4 + 15 + 30 * 2) + (4 + 21 + 41 * 2)
    big = [(256, 256), (256,)] * 4
    ratio = payload_bytes("fp4", big) / payload_bytes("none", big)
    assert 0.125 < ratio < 0.127, ratio  # codes + one fp32 scale per 1024 values
    assert payload_bytes("fp4", big) * 2 == pytest.approx(payload_bytes("int8", big), rel=0.01)
    # on the wire, shard by shard: an eighth of an fp32 ring all-reduce
    deltas = site_deltas(4, big, 17)
    _, fp32, _, _ = run_group("none", deltas)
    _, q, _, _ = run_group("fp4", deltas)
    assert 0.125 < q[0].bytes_sent / fp32[0].bytes_sent < 0.128


def test_fp4_is_a_quantizer_in_chains():
    assert [s.name for s in parse_codec_spec("powersgd:16+fp4")] == ["powersgd", "fp4"]
    assert [s.name for s in parse_codec_spec("topk:0.01+fp4")] == ["topk", "fp4"]
    with pytest.raises(ValueError, match="takes no argument"):
        parse_codec_spec("fp4:2")
    with pytest.raises(ValueError, match="int8/fp8/fp4"):
        parse_codec_spec("fp4+fp8")
    with pytest.raises(ValueError, match="int8/fp8/fp4 may follow"):
        parse_codec_spec("int8+topk:0.1")


# --- averaging -------------------------------------------------------------------------------


def test_group_average_is_the_fp32_mean_within_the_quantization_bound_and_equal_everywhere():
    shapes = [(5000,), (33, 31), (1001,), (7,)]  # odd chunks, some inside a shard, one alone
    deltas = site_deltas(3, shapes, 21)
    outs, _, _, _ = run_group("fp4", deltas)
    for i in range(len(shapes)):
        assert all(torch.equal(o[i], outs[0][i]) for o in outs[1:])  # bit-identical at every member
        xs = [chunked(d[i].reshape(-1), 1024)[0] for d in deltas]
        mean = sum(xs) / 3
        # each site's nearest-rounding error, then the shard owner's on the average it re-quantizes
        # (whose chunk max is at most the mean of the sites' chunk maxima)
        first = sum(e2m1_gap(x.abs(), x.abs().amax(1, keepdim=True) / 6) for x in xs) / 6
        scale = sum(x.abs().amax(1, keepdim=True) for x in xs) / 18
        second = torch.maximum(scale, mean.abs() + first) / 4  # half of e2m1_gap(a, s) <= max(s, a) / 2
        want = sum(d[i] for d in deltas) / 3
        err = chunked((outs[0][i] - want).reshape(-1), 1024)[0].abs()
        assert bool((err <= (first + second) * (1 + 1e-5) + 1e-7).all())
        rel = float(torch.linalg.norm(outs[0][i] - want) / torch.linalg.norm(want))
        assert 0.01 < rel < 0.2, rel


@pytest.mark.parametrize("spec", ["fp4", "topk:0.05+fp4", "powersgd:4+fp4"])
def test_contributions_decode_each_members_bytes_alike_everywhere(spec):
    shapes = [(48, 40), (1001,)]
    deltas = site_deltas(3, shapes, 22)
    comps = [Compressor(spec, seed=7, error_feedback=False) for _ in range(3)]
    res = run_sites(ThreadComm.group(3), lambda r, c: comps[r].contributions(deltas[r], c))
    per, weights, stats = res[0]
    assert weights == [1.0, 1.0, 1.0] and stats.payload == payload_bytes(spec, shapes)
    for p, _, _ in res[1:]:
        assert all(torch.equal(a, b) for a, b in zip(p, per, strict=True))
    for k in range(3):
        flat = torch.cat([d.reshape(-1) for d in deltas[k]])
        rel = float(torch.linalg.norm(per[k] - flat) / torch.linalg.norm(flat))
        if spec == "fp4":
            solo = torch.cat([roundtrip("fp4", d).reshape(-1) for d in deltas[k]])
            assert torch.equal(per[k], solo)  # a member's contribution is its own bytes decoded
        assert rel < (0.2 if spec == "fp4" else 1.0), rel


# --- state -----------------------------------------------------------------------------------


def test_shard_residual_survives_a_checkpoint_bit_for_bit():
    shapes = [(3000,), (40, 33)]
    comps = [Compressor("fp4", seed=5) for _ in range(3)]
    for r in range(2):
        run_group("fp4", site_deltas(3, shapes, 60 + r), comps=comps)
    saved = [checkpoint(c.state_dict()) for c in comps]
    sh = saved[1]["shards"]["0"]
    assert (sh["k"], sh["owner"]) == (3, 1) and float(sh["e"].abs().max()) > 0
    # the residual is per value, not per wire byte: about a third of the 4320 values
    assert math.isclose(sh["e"].numel(), 4320 / 3, rel_tol=0.5)
    fresh = [Compressor("fp4", seed=5) for _ in range(3)]
    for f, sd in zip(fresh, saved, strict=True):
        f.load_state_dict(sd)
    nxt = site_deltas(3, shapes, 70)
    a, _, _, _ = run_group("fp4", nxt, comps=comps)
    b, _, _, _ = run_group("fp4", nxt, comps=fresh)
    lost = [Compressor("fp4", seed=5) for _ in range(3)]
    for f, sd in zip(lost, saved, strict=True):
        f.load_state_dict({**sd, "shards": {}})
    c, _, _, _ = run_group("fp4", nxt, comps=lost)
    for i in range(len(shapes)):
        assert torch.equal(a[0][i], b[0][i])
    assert not all(torch.equal(a[0][i], c[0][i]) for i in range(len(shapes)))  # the shard residual mattered
