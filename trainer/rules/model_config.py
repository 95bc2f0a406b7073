"""The [model] section: the transformer's shape, its named sizes (presets), and what it holds.

No torch import: the control plane sizes runs with it (trainer.model builds the model from it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trainer.rules.tables import ConfigError


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    preset: str = "tiny"  # named size: tiny | small | 125m | 1b | 7b (fields below override it)
    dim: int = 0  # hidden size (0: from the preset)
    n_layers: int = 0  # transformer blocks (0: from the preset)
    n_heads: int = 0  # attention heads (0: from the preset)
    n_kv_heads: int = 0  # key/value heads for grouped-query attention (0: = n_heads)
    ffn_hidden: int = 0  # SwiGLU hidden size (0: from the preset)
    vocab_size: int = 0  # tokens; 256 for byte-level text (0: from the preset)
    max_seq_len: int = 0  # longest sequence RoPE is prepared for (0: from the preset)
    rope_theta: float = 10000.0  # RoPE base
    norm_eps: float = 1e-5  # RMSNorm epsilon
    tie_embeddings: bool = False  # share the input embedding with the output head


# name -> (dim, n_layers, n_heads, n_kv_heads, ffn_hidden, vocab_size, max_seq_len)
PRESETS: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "tiny": (64, 2, 4, 2, 176, 256, 128),  # CPU tests: ~0.1M parameters
    "small": (384, 6, 6, 6, 1024, 256, 256),  # CPU benchmarks: ~10.8M parameters
    "125m": (768, 12, 12, 12, 1792, 32000, 2048),  # GPU: ~127M
    "1b": (2048, 24, 16, 8, 3840, 32000, 2048),  # GPU: ~1.00B (24 layers: 8 or 4 pipeline stages)
    "7b": (4096, 32, 32, 32, 11008, 32000, 4096),  # GPU: ~6.74B (LLaMA-2 7B shape)
}


def resolve_model(cfg: ModelConfig) -> ModelConfig:
    """Fill the zero fields of `cfg` from its preset."""
    if cfg.preset not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {cfg.preset!r} (known: {', '.join(PRESETS)})")
    dim, layers, heads, kv, ffn, vocab, seq = PRESETS[cfg.preset]
    out = dataclasses.replace(cfg)
    for name, value in (("dim", dim), ("n_layers", layers), ("n_heads", heads), ("n_kv_heads", kv),
                        ("ffn_hidden", ffn), ("vocab_size", vocab), ("max_seq_len", seq)):
        if getattr(out, name) == 0:
            setattr(out, name, value)
    if out.dim % out.n_heads:
        raise ConfigError(f"model.dim: {out.dim} is not divisible by n_heads {out.n_heads}")
    if out.n_heads % out.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads: {out.n_kv_heads} does not divide n_heads {out.n_heads}")
    if (out.dim // out.n_heads) % 2:  # rotary embeddings turn pairs of a head's channels
        raise ConfigError(f"model.dim: {out.dim} / n_heads {out.n_heads} = head dimension {out.dim // out.n_heads}, "
                          f"which must be even for rotary embeddings")
    return out


def param_count(cfg: ModelConfig) -> int:
    """Exact number of parameters of the model `trainer.model.Transformer` builds for `cfg`."""
    m = resolve_model(cfg)
    head_dim = m.dim // m.n_heads
    attn = m.dim * m.dim * 2 + m.dim * m.n_kv_heads * head_dim * 2  # q, o, k, v (no biases)
    mlp = 3 * m.dim * m.ffn_hidden  # SwiGLU: w1, w3 in, w2 out
    block = attn + mlp + 2 * m.dim  # two RMSNorm weights
    embed = m.vocab_size * m.dim * (1 if m.tie_embeddings else 2)
    return m.n_layers * block + embed + m.dim  # final norm


def param_tensors(m: ModelConfig) -> int:
    """Parameter tensors of the `trainer.model.Transformer` built for `m`: per block 4 attention and 3
    feed-forward matrices and 2 norms; the embedding, the final norm and (untied) the output head."""
    m = resolve_model(m)
    return 9 * m.n_layers + 2 + (0 if m.tie_embeddings else 1)
