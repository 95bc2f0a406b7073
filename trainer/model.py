"""A LLaMA-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases.

Module names follow torchtitan (`tok_embeddings`, `layers["i"].attention.wq`, ...) so tensor
and pipeline parallel plans can address them. `layers` is a ModuleDict keyed "0".."n-1" and
`tok_embeddings`, `norm`, `output` may be set to None: a pipeline stage deletes what it does not
own and `forward` skips it, as in torchtitan.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from trainer.rules.model_config import ModelConfig, resolve_model

INIT_STD = 0.02  # normal init of every matrix; residual output projections get it / sqrt(2 * n_layers)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32: bf16 mean-of-squares loses too many bits
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_seq_len, head_dim // 2] for rotary embeddings."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of x [B, T, H, D] by the position angles (cos/sin are [T, D/2])."""
    # interleaved pairs (x0, x1), (x2, x3), ...: the layout of Meta's and torchtitan's complex form
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # head counts come from the tensors (-1), not the config: under tensor parallel each rank
        # holds only its share of the heads
        q = self.wq(x).view(b, t, -1, self.head_dim)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        n_rep = q.shape[2] // k.shape[2]
        if n_rep > 1:  # query head h reads key/value head h // n_rep
            k = k.repeat_interleave(n_rep, dim=2)
            v = v.repeat_interleave(n_rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Decoder-only LM: tokens [B, T] (long) -> logits [B, T, vocab_size]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg = resolve_model(cfg)  # idempotent on an already resolved config
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        # derived from the config, so kept out of checkpoints (persistent=False)
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.init_rope()

    def tie_weights(self) -> None:
        """Share the embedding with the output head when configured (`to_empty` unties them)."""
        if self.cfg.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def init_rope(self) -> None:
        """(Re)compute the RoPE tables on the model's device, e.g. after `to_empty` from meta."""
        device = self.rope_cos.device
        cos, sin = rope_tables(self.cfg.dim // self.cfg.n_heads, self.cfg.max_seq_len, self.cfg.rope_theta, device)
        self.rope_cos, self.rope_sin = cos, sin

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init: each tensor drawn from a CPU generator seeded by (seed, its name).

        A CPU generator gives the same bits whatever device the model lives on, and seeding per
        name makes a tensor's values independent of which other modules exist (pipeline stages).
        """
        residual_std = INIT_STD / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():  # tied weights appear once, under tok_embeddings
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            std = residual_std if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")) else INIT_STD
            g = torch.Generator().manual_seed(_name_seed(seed, name))
            p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=g))
        self.init_rope()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds model.max_seq_len {self.cfg.max_seq_len}")
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def _name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def build_model(cfg: ModelConfig, seed: int, device: str | torch.device = "cpu") -> Transformer:
    """Build and initialise a Transformer; the same seed gives bitwise-equal parameters anywhere.

    On device "meta" nothing is allocated or initialised: call `to_empty(device=...)`,
    `tie_weights()` and `init_weights(seed)` to materialise it.
    """
    with torch.device("meta"):
        model = Transformer(cfg)
    if torch.device(device).type == "meta":
        return model
    model = model.to_empty(device=device)
    model.tie_weights()
    model.init_weights(seed)
    return model


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; logits [B, T, V], targets [B, T]."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
