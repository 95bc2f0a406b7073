"""Throughput of each compression codec, side by side with a plain tensor copy (a benchmark, not a test).

    python3 bench/codecs.py [--params 4] [--repeat 3] [--threads 1] [--specs int8,fp8,...]

Per codec: one site's full round with a group of one (SoloComm): error feedback added, encoded
into the wire buffer, decoded, residual updated; MB/s of fp32 input (best of --repeat runs). In a
K-site group, int8/fp8 (and PowerSGD's quantized factors) are averaged shard by shard: each site
decodes K shards of 1/K of the payload (one payload's worth), re-quantizes its shard and copies
the gathered shards back; top-k decodes K whole contributions, K times what is shown here.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.codecs.compression import Compressor  # noqa: E402
from trainer.collectives import SoloComm  # noqa: E402
from trainer.rules.codec_spec import CodecOptions, payload_bytes  # noqa: E402

SPECS = ["none", "int8", "int8/sr", "int8/fp16-scale", "fp8", "topk:0.01", "topk:0.01+int8",
         "powersgd:16", "powersgd:16+int8", "powersgd:64+fp8"]


def shapes_for(millions: float) -> list[tuple[int, ...]]:
    """Transformer-like parameter shapes (dim 512 blocks: attention, SwiGLU, norms), ~N million in all."""
    block = [(512, 512)] * 4 + [(1408, 512), (1408, 512), (512, 1408), (512,), (512,)]
    per = sum(a * (b[0] if b else 1) for a, *b in block)  # 3.2M
    n = max(1, round(millions * 1e6 / per))
    return block * n


def best_of(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=4.0, help="millions of fp32 parameters")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: default)")
    ap.add_argument("--specs", default=",".join(SPECS), help="comma list; /sr, /fp16-scale variants")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = shapes_for(args.params)
    g = torch.Generator().manual_seed(0)
    deltas = [torch.randn(s, generator=g) * 1e-3 for s in shapes]
    mb = sum(d.numel() for d in deltas) * 4 / 1e6
    dense = payload_bytes("none", shapes)

    copy_s = best_of(args.repeat, lambda: [d.clone() for d in deltas])
    print(f"{len(shapes)} tensors, {mb:.1f} MB fp32, torch threads {torch.get_num_threads()}, best of {args.repeat}")
    print(f"{'codec':<18} {'wire MB':>8} {'ratio':>7} {'MB/s':>9} {'vs copy':>8} {'rel err':>8}")
    print(f"{'copy (clone)':<18} {mb:>8.2f} {1:>7.1f} {mb / copy_s:>9.0f} {1:>8.3f} {0:>8.4f}")
    for name in args.specs.split(","):
        spec, _, variant = name.partition("/")
        opts = CodecOptions(stochastic=variant == "sr", scale_dtype="fp16" if variant == "fp16-scale" else "fp32")
        comp = Compressor(spec, error_feedback=True, seed=0, options=opts)
        comm = SoloComm()
        first, _ = comp.average(deltas, comm)  # plans, allocates; round-1 output for the error column
        num = sum(float(((o - d) ** 2).sum()) for o, d in zip(first, deltas, strict=True))
        rel = (num / sum(float((d**2).sum()) for d in deltas)) ** 0.5
        secs = best_of(args.repeat, lambda c=comp, m=comm: c.average(deltas, m))
        wire = payload_bytes(spec, shapes, opts)
        print(f"{name:<18} {wire / 1e6:>8.2f} {dense / wire:>7.1f} {mb / secs:>9.0f} {copy_s / secs:>8.3f} {rel:>8.4f}")


if __name__ == "__main__":
    main()
