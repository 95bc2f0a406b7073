"""The sparse codec (trainer.codecs.sparse_codec): records, the sharded reduction, its owners' screening."""

import math

import pytest
import torch

from trainer.codecs.compression import Compressor
from trainer.codecs.sparse_codec import (
    SparseShards,
    _pack_offsets,
    _unpack_offsets,
    balanced_bounds,
    decode,
    encode,
)
from trainer.collectives import SoloComm, ThreadComm, run_sites
from trainer.outer.guard import GuardRule, guarded_average
from trainer.rules.codec_spec import CodecOptions, offset_bytes, parse_codec_spec, payload_bytes, wire_plan
from trainer.rules.config import from_dict
from trainer.rules.tables import ConfigError

SHAPES = [(64, 70), (64,), (100, 90), (5,)]  # chunks of 4096 with a short last one, tiny vectors


def deltas_for(k, seed=0, scale=1e-2):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) * scale for s in SHAPES] for _ in range(k)]


def flat(ts):
    return torch.cat([t.reshape(-1) for t in ts])


def run_avg(deltas, spec="sparse:0.02", **kw):
    comps = [Compressor(spec, error_feedback=False) for _ in deltas]
    return run_sites(ThreadComm.group(len(deltas)), lambda r, comm: comps[r].average(deltas[r], comm, 1.0, **kw)), comps


@pytest.mark.parametrize("block,k,size", [(4096, 41, 44), (4096, 164, 135), (4096, 40, 43), (4096, 1, 2),
                                          (4096, 4096, 1024), (65536, 7, 14), (100, 3, 3), (7, 7, 2)])
def test_offsets_pack_and_unpack(block, k, size):
    g = torch.Generator().manual_seed(block + k)
    idx = torch.stack([torch.randperm(block, generator=g)[:k].sort().values for _ in range(5)])
    raw = _pack_offsets(idx, block)
    assert raw.shape == (5, size) == (5, offset_bytes(block, k)) and raw.dtype == torch.uint8
    assert size <= math.ceil(k * (12 if block <= 4096 else 16) / 8) or k == 1  # never over fixed 12/16-bit ones
    assert torch.equal(_unpack_offsets(raw, k, block), idx)


def test_offsets_of_many_chunks_are_coded_in_slices_alike():
    g = torch.Generator().manual_seed(1)
    idx = torch.stack([torch.randperm(4096, generator=g)[:41].sort().values for _ in range(20000)])
    raw = _pack_offsets(idx, 4096)
    assert torch.equal(raw[-3:], _pack_offsets(idx[-3:], 4096))
    assert torch.equal(_unpack_offsets(raw, 41, 4096), idx)


@pytest.mark.parametrize("raw", [torch.zeros(2, 44, dtype=torch.uint8), torch.full((2, 44), 255, dtype=torch.uint8)])
def test_lying_offset_bytes_still_decode_inside_the_chunk(raw):
    """No honest encoder writes a bitmap without exactly k ones; a peer may: its offsets stay in the chunk."""
    idx = _unpack_offsets(raw, 41, 4096)
    assert idx.shape == (2, 41) and int(idx.min()) >= 0 and int(idx.max()) < 4096


@pytest.mark.parametrize("vec", ["int2", "int8"])
@pytest.mark.parametrize("n,block,k", [(10000, 4096, 41), (64, 64, 1), (20000, 8192, 82), (7, 100, 3)])
def test_records_carry_each_chunks_largest_values(vec, n, block, k):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    mags, offs, q = encode(x, block, k, vec)
    pos, vals = decode(mags, offs, q, block, k, vec, n)
    want = set()
    for b in range(0, n, block):
        chunk = x[b:b + block]
        want |= {b + int(i) for i in chunk.abs().topk(min(k, len(chunk))).indices}
    assert set(pos.tolist()) == want
    assert torch.equal(vals > 0, x[pos] > 0)
    if vec == "int2":  # every value is one of its chunk's two magnitudes
        levels = mags.float()
        for p, v in zip(pos.tolist(), vals.abs().tolist(), strict=True):
            assert v in levels[p // block].tolist()
    else:
        assert float((vals - x[pos]).abs().max()) <= float(mags[:, 0].float().max()) / 2 + 1e-6


def test_int2_magnitudes_are_the_means_either_side_of_the_mean():
    x = torch.tensor([1.0, -1.0, 2.0, -4.0, 8.0, 0.0, 0.0, 0.0])
    mags, _, _ = encode(x, 8, 5, "int2")
    assert mags.float().tolist() == [[pytest.approx(4 / 3, rel=1e-3), pytest.approx(6.0)]]


def test_payload_is_what_reaches_the_comm_and_275x_under_fp32():
    shapes = [(4096, 16)]
    plan = wire_plan("sparse:0.01", shapes)
    assert plan.phases[0].op == "ssum"
    # per chunk of 4096: 2 fp16 magnitudes, 41 offsets in 44 bytes (Elias-Fano), 41 values of 2 bits
    assert payload_bytes("sparse:0.01", shapes) == 4 + 16 * (4 + 44 + 11)
    assert payload_bytes("sparse:0.01+int8", shapes) == 4 + 16 * (4 + 44 + 41)
    assert 4 * 4096 * 16 / payload_bytes("sparse:0.01", shapes) > 275
    out, stats = Compressor("sparse:0.01").average([torch.randn(4096, 16)], SoloComm())
    assert stats.payload == payload_bytes("sparse:0.01", shapes)
    assert int((out[0] != 0).sum()) == 16 * 41


def test_bad_chains_are_refused():
    assert [s.name for s in parse_codec_spec("sparse:0.01")] == ["sparse", "int2"]
    for bad in ("sparse:0", "sparse:1.5", "sparse:0.01+fp8", "int2", "topk:0.01+int2", "int8+sparse:0.1"):
        with pytest.raises(ValueError):
            parse_codec_spec(bad)


@pytest.mark.parametrize("k", [2, 3, 4])
def test_every_site_gets_bit_identical_averages(k):
    out, _ = run_avg(deltas_for(k))
    first = flat(out[0][0])
    assert all(torch.equal(flat(o[0]), first) for o in out)
    assert int((first != 0).sum()) > 0


def test_identical_inputs_average_to_themselves():
    d = deltas_for(1)[0]
    solo, _ = Compressor("sparse:0.02", error_feedback=False).average(d, SoloComm())
    out, _ = run_avg([d] * 3)
    assert torch.allclose(flat(out[0][0]), flat(solo), rtol=1e-3, atol=1e-7)


def test_each_coordinate_is_averaged_over_its_senders():
    # two sites send disjoint coordinates: each keeps its full value, not half of it
    a, b = torch.zeros(4096), torch.zeros(4096)
    a[:41], b[41:82] = 1.0, -2.0
    out, _ = run_avg([[a], [b]], spec="sparse:0.01+int8")
    avg = out[0][0][0]
    got = set(torch.nonzero(avg).view(-1).tolist())
    assert len(got) == 41 and got <= set(range(82))  # re-selected to k of the 82 sent
    assert torch.allclose(avg[avg != 0].abs(), torch.full((41,), 2.0), rtol=0.01)


def test_bytes_on_the_wire_do_not_grow_with_the_sites():
    sent = {}
    for k in (2, 4, 8):
        g = torch.Generator().manual_seed(k)
        d = [[torch.randn(300, 400, generator=g)] for _ in range(k)]  # 30 chunks: shards of whole chunks
        out, _ = run_avg(d)
        sent[k] = out[0][1].bytes_sent
        payload = out[0][1].payload
        # a ring all-reduce's 2(K-1)/K of the payload, give or take a chunk per shard
        assert sent[k] <= 2 * (k - 1) / k * payload * 1.3, (k, sent[k], payload)
    gather = [Compressor("topk:0.02+int8").contributions(deltas_for(1)[0], SoloComm())[2].payload * (k - 1)
              for k in (2, 8)]
    assert sent[8] / sent[2] < 2.5 and gather[1] / gather[0] == 7


def test_owner_residual_keeps_what_reselection_dropped_and_is_checkpointed():
    d = deltas_for(3)
    comps = [Compressor("sparse:0.01", error_feedback=True, decay=1.0) for _ in d]
    run_sites(ThreadComm.group(3), lambda r, comm: comps[r].average(d[r], comm, 1.0))
    sd = comps[1].state_dict()
    e = sd["shards"]["0"]["e"]
    assert sd["shards"]["0"]["k"] == 3 and sd["shards"]["0"]["owner"] == 1 and float(e.abs().sum()) > 0
    # a resumed site carries on exactly as the one that never stopped
    twin = Compressor("sparse:0.01", error_feedback=True, decay=1.0)
    twin.load_state_dict(sd)
    nxt = deltas_for(3, seed=9)
    a = run_sites(ThreadComm.group(3), lambda r, comm: comps[r].average(nxt[r], comm, 1.0))
    comps[1] = twin
    for c in comps:
        c.load_state_dict(c.state_dict())
    assert torch.equal(flat(comps[1].state_dict()["shards"]["0"]["e"]), flat(e))
    assert int((flat(a[0][0]) != 0).sum()) > 0


def guarded(deltas, rule, liars=None, weights=None, spec="sparse:0.02"):
    liars = liars or {}
    comps = [Compressor(spec, error_feedback=False) for _ in deltas]
    sends = [[liars[r](t) for t in deltas[r]] if r in liars else deltas[r] for r in range(len(deltas))]
    return run_sites(ThreadComm.group(len(deltas)), lambda r, comm: guarded_average(
        comps[r], sends[r], comm, weights[r] if weights else 1.0, f"site{r}", rule))


def test_owners_drop_an_outsized_contribution_and_every_site_says_so():
    d = deltas_for(4, seed=3)
    res = guarded(d, GuardRule(aggregate="mean", norm_ratio=3.0), liars={2: lambda t: t * 100})
    assert all(r.rejected == res[0].rejected for r in res)
    assert [name for name, _ in res[0].rejected] == ["site2"]
    assert res[0].k_active == 3 and not res[0].failed
    honest = guarded([d[0], d[1], d[3]], GuardRule(aggregate="mean", norm_ratio=3.0))
    big = float(flat(res[0].avg).abs().max())
    assert big < 10 * float(flat(honest[0].avg).abs().max())
    assert all(torch.equal(flat(r.avg), flat(res[0].avg)) for r in res)


def test_a_claimed_weight_other_than_one_drops_the_site():
    d = deltas_for(3, seed=4)
    res = guarded(d, GuardRule(aggregate="mean"), weights=[1.0, 7.0, 1.0])
    assert res[0].rejected == [("site1", "weight 7 claimed; a site's weight is 0 or 1: dropped")]
    assert res[0].k_active == 2


def test_two_sites_that_disagree_refuse_the_round():
    d = deltas_for(2, seed=5)
    res = guarded(d, GuardRule(aggregate="mean", norm_ratio=3.0), liars={1: lambda t: t * 50})
    assert all(r.failed and r.avg is None for r in res)
    assert "site0, site1" in res[0].failed


def test_non_finite_magnitudes_from_a_liar_are_dropped_by_the_owner():
    class Liar(Compressor):
        def _encode_first(self, xs, weight):
            buf = super()._encode_first(xs, weight)
            for r in self.plan.routes:
                buf.view(r.index, "sparse.scale").fill_(float("inf"))
            return buf

    d = deltas_for(3, seed=6)
    comps = [Liar("sparse:0.02", error_feedback=False) if r == 1 else Compressor("sparse:0.02", error_feedback=False)
             for r in range(3)]
    res = run_sites(ThreadComm.group(3), lambda r, comm: guarded_average(
        comps[r], d[r], comm, 1.0, f"site{r}", GuardRule(aggregate="mean", norm_ratio=3.0)))
    assert [n for n, _ in res[0].rejected] == ["site1"]
    assert bool(torch.isfinite(flat(res[0].avg)).all())


def test_thirty_two_sites_are_refused_in_one_line():
    with pytest.raises(ValueError, match="at most 31 sites"):
        run_avg(deltas_for(32))


def test_group_of_one_and_weight_zero():
    d = deltas_for(2, seed=7)
    comps = [Compressor("sparse:0.02", error_feedback=True) for _ in d]
    out = run_sites(ThreadComm.group(2), lambda r, comm: comps[r].average(d[r], comm, 0.0 if r == 1 else 1.0))
    solo, _ = Compressor("sparse:0.02", error_feedback=False).average(d[0], SoloComm())
    assert torch.allclose(flat(out[1][0]), flat(solo), rtol=1e-3, atol=1e-7)
    assert CodecOptions().topk_block == 4096


def test_presets_expand_and_an_explicit_key_wins():
    d = from_dict({"diloco": {"compression": "sparseloco"}}).diloco
    assert (d.compression, d.codec_sparse_merge, d.outer_momentum, d.outer_lr, d.error_feedback_decay) == (
        "sparse:0.0175", 4, 0.0, 1.0, 0.95)
    d = from_dict({"diloco": {"compression": "SparseLoCo", "outer_lr": 0.7}}).diloco
    assert (d.compression, d.outer_lr) == ("sparse:0.0175", 0.7)
    assert from_dict({"diloco": {"compression": "powersgd"}}).diloco.compression == "powersgd:16+int8"
    with pytest.raises(ConfigError, match="presets: powersgd, sparseloco"):
        from_dict({"diloco": {"compression": "sparse-loco"}})
    with pytest.raises(ConfigError, match="'median' combines coordinate by coordinate, but a sparse codec"):
        from_dict({"diloco": {"compression": "sparseloco", "aggregate": "median", "sites": 3}})


def test_a_wider_merge_keeps_more_of_the_union_for_fewer_than_that_many_times_the_bytes():
    g = torch.Generator().manual_seed(11)
    d = [[torch.randn(300, 400, generator=g)] for _ in range(4)]
    plain, _ = run_avg(d)
    comps = [Compressor("sparse:0.02", error_feedback=False, options=CodecOptions(sparse_merge=4)) for _ in d]
    wide = run_sites(ThreadComm.group(4), lambda r, comm: comps[r].average(d[r], comm, 1.0))
    assert all(torch.equal(flat(o[0]), flat(wide[0][0])) for o in wide)
    n_plain, n_wide = int((flat(plain[0][0]) != 0).sum()), int((flat(wide[0][0]) != 0).sum())
    assert n_wide > 3 * n_plain  # four sites' choices barely overlap at 2%
    mean = sum(flat(x) for x in d) / 4
    cos = [float(flat(o[0][0]) @ mean / flat(o[0][0]).norm() / mean.norm()) for o in (plain, wide)]
    assert cos[1] > cos[0], cos
    plan = wire_plan("sparse:0.02", [(300, 400)], CodecOptions(sparse_merge=4))
    # 4x the values, 3x the bytes: an Elias-Fano offset of 8% of a chunk costs 5 bits, one of 2% 7
    assert 2.9 < plan.phases[0].merged / wire_plan("sparse:0.02", [(300, 400)]).phases[0].merged < 3.2
    assert wide[0][1].bytes_sent > 2 * plain[0][1].bytes_sent
    with pytest.raises(ConfigError, match="codec_sparse_merge: must be in"):
        from_dict({"diloco": {"compression": "sparseloco", "codec_sparse_merge": 0}})


def test_the_byte_model_counts_what_the_exchange_sends():
    from dilococtl.tune.transfer import collective_bytes, phases

    for merge in (1, 2):
        opts = CodecOptions(sparse_merge=merge)
        g = torch.Generator().manual_seed(merge)
        d = [[torch.randn(600, 400, generator=g)] for _ in range(4)]
        comps = [Compressor("sparse:0.01", error_feedback=False, options=opts) for _ in d]
        sent = run_sites(ThreadComm.group(4), lambda r, comm, c=comps, d=d: c[r].average(d[r], comm, 1.0))[0][1].bytes_sent
        (op, n), _digest = phases("sparse:0.01", [(600, 400)], opts, sites=4)
        assert op == "qsum" and abs(collective_bytes(op, n, 4) - sent) / sent < 0.1, (merge, n, sent)


def test_shards_are_cut_so_the_largest_is_as_small_as_a_contiguous_cut_allows():
    """Every message of a phase is padded to its largest shard: cut at shares of the total, the tiny model's
    shards at 4 sites were [662, 828, 662, 835] bytes (chunks an eighth of a shard), 12.7% over the ideal."""
    assert balanced_bounds([], 3) == [0, 0, 0, 0]
    assert balanced_bounds([5], 3) == [0, 0, 0, 1]  # fewer chunks than shards: some shards are empty
    assert balanced_bounds([1, 1, 1, 9], 2) == [0, 3, 4]
    assert balanced_bounds([9, 1, 1, 1], 2) == [0, 1, 4]
    assert balanced_bounds([4, 4, 4, 4], 3) in ([0, 1, 2, 4], [0, 2, 3, 4], [0, 1, 3, 4])
    from trainer.model import Transformer
    from trainer.rules.model_config import ModelConfig, resolve_model

    shapes = [tuple(p.shape) for p in Transformer(resolve_model(ModelConfig(preset="tiny"))).parameters()]
    opts = CodecOptions(sparse_merge=4)
    plan = wire_plan("sparse:0.0175", shapes, opts)
    sh = SparseShards(plan.phases[0], plan.routes, 4, opts)
    ideal = (plan.phases[0].nbytes - 4 + plan.phases[0].merged) / 4 + 2 * 8  # a quarter of each, two headers
    assert ideal < sh.msg + sh.msg_out < 1.02 * ideal  # cut at shares of the total: 1.12 x ideal
