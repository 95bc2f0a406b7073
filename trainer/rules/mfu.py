"""Model FLOPs utilisation (MFU): the tokens a site trains per second, times the training FLOPs of a
token, over the peak FLOP/s of the site's devices. No torch: the trainer writes the two constants in
its `start` event and the control plane divides (dilococtl.metrics).

The convention torchtitan and PaLM report MFU with: a token's forward and backward FLOPs are
6N + 12·L·dim·T (N the matmul parameters, the full T×T attention counted), and the peak is the
device's dense bf16 tensor-core figure from its datasheet, once per process (one device each).
A device not in PEAK_TFLOPS (a CPU, an unlisted GPU) has no peak unless `train.peak_tflops` gives
it, and no MFU is shown for it.
"""

from __future__ import annotations

import math

from trainer.rules.model_config import ModelConfig, param_count, resolve_model

# dense bf16 TFLOP/s per device, by a part of its name (torch.cuda.get_device_name); the first match
# wins, so a name that holds another's comes first (NVIDIA datasheets: SXM parts, no sparsity)
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.4), ("H200", 989.4), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4),
    ("H800", 989.4), ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.1),
)


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM's 6N + 12·L·dim·T.

    N leaves out the input embedding (a lookup, not a matmul); with tied embeddings the shared
    matrix still does the output matmul, so it stays in. The attention term counts the full
    T×T score matrix, the convention torchtitan and PaLM report MFU with.
    """
    m = resolve_model(cfg)
    n = param_count(m) - (0 if m.tie_embeddings else m.vocab_size * m.dim)
    return float(6 * n + 12 * m.n_layers * m.dim * seq_len)


def device_peak_flops(device_name: str, peak_tflops: float = 0.0) -> float | None:
    """Peak FLOP/s of one device: `peak_tflops` (train.peak_tflops) when set, else the datasheet
    figure of a known device by its name; None when unknown."""
    if peak_tflops > 0:
        return peak_tflops * 1e12
    for part, tflops in PEAK_TFLOPS:
        if part.lower() in device_name.lower():
            return tflops * 1e12
    return None


def mfu(tokens_per_s: object, flops_per_token: object, peak_flops: object) -> float | None:
    """tokens/s x FLOPs per token / peak FLOP/s; None unless all three are finite positive numbers
    (they come from the records: a site's word, not ours)."""
    xs = (tokens_per_s, flops_per_token, peak_flops)
    if not all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in xs):
        return None
    return float(tokens_per_s) * float(flops_per_token) / float(peak_flops)  # type: ignore[arg-type]
