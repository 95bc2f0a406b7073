import math

import pytest
import torch

from trainer.model import (
    Transformer,
    apply_rope,
    build_model,
    loss_fn,
    rope_tables,
)
from trainer.rules.mfu import model_flops_per_token
from trainer.rules.model_config import PRESETS, ModelConfig, param_count, resolve_model


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def tiny(**kw) -> ModelConfig:
    return resolve_model(ModelConfig(preset="tiny", **kw))


def test_forward_shape_and_initial_loss_near_uniform():
    cfg = tiny()
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert logits.shape == (3, 20, 256)
    targets = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(1))
    # small init: predictions are close to uniform over 256 bytes
    assert abs(loss_fn(logits, targets).item() - math.log(256)) < 0.15


def test_causal_later_token_does_not_change_earlier_logits():
    model = build_model(tiny(), seed=0)
    a = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    b = a.clone()
    b[:, 10] = (b[:, 10] + 7) % 256
    la, lb = model(a), model(b)
    torch.testing.assert_close(la[:, :10], lb[:, :10], rtol=0, atol=1e-6)
    assert (la[:, 10:] - lb[:, 10:]).abs().amax(dim=-1).min() > 1e-5  # every later position sees it


def test_gqa_shapes():
    cfg = tiny()  # 4 query heads share 2 key/value heads
    model = build_model(cfg, seed=0)
    attn = model.layers["0"].attention
    hd = cfg.dim // cfg.n_heads
    assert attn.wq.weight.shape == (cfg.n_heads * hd, cfg.dim)
    assert attn.wk.weight.shape == (cfg.n_kv_heads * hd, cfg.dim) == (32, 64)
    assert attn.wv.weight.shape == (32, 64)
    assert attn.wo.weight.shape == (cfg.dim, cfg.n_heads * hd)
    mqa = build_model(tiny(n_kv_heads=1), seed=0)
    assert mqa.layers["1"].attention.wk.weight.shape == (16, 64)
    assert mqa(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, 256)


def test_gqa_equals_mha_with_repeated_kv_heads():
    """Query head h must read kv head h // (n_heads / n_kv_heads)."""
    gqa = build_model(tiny(), seed=5)
    mha = Transformer(tiny(n_kv_heads=4))
    sd = gqa.state_dict()
    hd = 16
    for key in list(sd):
        if key.endswith(("wk.weight", "wv.weight")):
            sd[key] = sd[key].view(2, hd, 64).repeat_interleave(2, dim=0).reshape(4 * hd, 64)
    mha.load_state_dict(sd)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(mha(tokens), gqa(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("tie", [False, True])
def test_param_count_matches_config(preset, tie):
    cfg = ModelConfig(preset=preset, tie_embeddings=tie)
    model = build_model(cfg, seed=0, device="meta")  # no memory even for 7b
    assert next(model.parameters()).is_meta
    assert sum(p.numel() for p in model.parameters()) == param_count(cfg)


def test_torchtitan_names_and_rope_not_in_state_dict():
    model = build_model(tiny(), seed=0)
    keys = set(model.state_dict())
    for name in ["tok_embeddings.weight", "layers.0.attention_norm.weight", "layers.1.attention.wq.weight",
                 "layers.1.attention.wk.weight", "layers.1.attention.wv.weight", "layers.1.attention.wo.weight",
                 "layers.0.ffn_norm.weight", "layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w2.weight",
                 "layers.0.feed_forward.w3.weight", "norm.weight", "output.weight"]:
        assert name in keys
    assert not any("rope" in k or "bias" in k for k in keys)
    assert all("rope" not in n for n, _ in model.named_parameters())
    assert model.rope_cos.shape == (128, 8)


def test_tied_embeddings_share_one_tensor():
    model = build_model(tiny(tie_embeddings=True), seed=0)
    assert model.output.weight is model.tok_embeddings.weight
    untied = build_model(tiny(), seed=0)
    assert not torch.equal(untied.output.weight, untied.tok_embeddings.weight)


def test_deterministic_init_and_scaled_residual_projections():
    cfg = resolve_model(ModelConfig(preset="small"))
    a, b, c = build_model(cfg, seed=3), build_model(cfg, seed=3), build_model(cfg, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.0.attention.wq.weight"], sc["layers.0.attention.wq.weight"])
    assert torch.equal(sa["norm.weight"], torch.ones(cfg.dim))
    # no two tensors share a random stream
    assert not torch.equal(sa["layers.0.attention.wq.weight"], sa["layers.1.attention.wq.weight"])
    assert sa["layers.2.feed_forward.w1.weight"].std().item() == pytest.approx(0.02, rel=0.02)
    residual = 0.02 / math.sqrt(2 * cfg.n_layers)
    assert sa["layers.2.feed_forward.w2.weight"].std().item() == pytest.approx(residual, rel=0.02)
    assert sa["layers.2.attention.wo.weight"].std().item() == pytest.approx(residual, rel=0.02)


def test_meta_then_materialise_equals_direct_build():
    cfg = tiny(tie_embeddings=True)
    direct = build_model(cfg, seed=9)
    late = build_model(cfg, seed=9, device="meta").to_empty(device="cpu")
    late.tie_weights()
    late.init_weights(9)
    tokens = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(direct(tokens), late(tokens))


def test_rope_scores_depend_only_on_relative_position():
    cos, sin = rope_tables(16, 64, 10000.0)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(16, generator=g), torch.randn(16, generator=g)
    seq = lambda v: v.expand(1, 64, 1, 16)  # noqa: E731  same vector at every position
    rq, rk = apply_rope(seq(q), cos, sin)[0, :, 0], apply_rope(seq(k), cos, sin)[0, :, 0]
    assert torch.dot(rq[5], rk[2]).item() == pytest.approx(torch.dot(rq[40], rk[37]).item(), abs=1e-4)
    assert torch.dot(rq[5], rk[2]).item() != pytest.approx(torch.dot(rq[5], rk[4]).item(), abs=1e-3)
    assert rq.norm(dim=-1).sub(q.norm()).abs().max() < 1e-4  # a rotation keeps the norm


def test_too_long_sequence_is_rejected():
    model = build_model(tiny(), seed=0)
    with pytest.raises(ValueError, match="max_seq_len 128"):
        model(torch.zeros(1, 129, dtype=torch.long))


def test_adamw_lowers_loss_on_fixed_batch():
    torch.manual_seed(0)
    model = build_model(tiny(), seed=1)
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(2))
    x, y = tokens[:, :-1], tokens[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    losses = []
    for _ in range(30):
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_model_flops_per_token():
    cfg = ModelConfig(preset="tiny")
    m = resolve_model(cfg)
    # tiny by hand: per layer 2*64*64 (q,o) + 2*64*32 (k,v) + 3*64*176 + 2*64; final norm; output head
    non_embedding = 2 * (2 * 4096 + 2 * 2048 + 3 * 64 * 176 + 128) + 64 + 256 * 64
    assert model_flops_per_token(cfg, 128) == 6 * non_embedding + 12 * m.n_layers * m.dim * 128
    # tied: the shared matrix is the output matmul, so the count is the same
    assert model_flops_per_token(ModelConfig(preset="tiny", tie_embeddings=True), 128) == model_flops_per_token(cfg, 128)
    big = model_flops_per_token(ModelConfig(preset="7b"), 4096)
    assert 6 * 6.4e9 < big < 6 * 6.74e9 + 12 * 32 * 4096 * 4096 + 1
