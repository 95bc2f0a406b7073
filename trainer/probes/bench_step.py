"""Time the inner step of a run's model and batch: `python -m trainer.probes.bench_step --config FILE`.

Builds the model with `trainer.model.build_model`, runs AdamW steps (the trainer's betas, weight
decay and gradient clipping, bf16 autocast on CUDA when configured) on random tokens of the
configured batch (data.batch_size x data.seq_len per process), and prints one JSON line:
{"step_s": median seconds of the timed steps, "steps": ..., "warmup": ..., "device": ...,
"params": ..., "threads": ..., "tokens_per_step": ...}.

It runs ONE process: a site with several data-parallel processes takes about this long per step
plus its gradient all-reduce inside the site, which this benchmark leaves out (tensor and pipeline
parallelism are not modelled either). Random tokens cost the same as real ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def bench(cfg, steps: int = 10, warmup: int = 3) -> dict:
    """Median wall seconds of one inner step of `cfg` (a validated TrainerConfig) after `warmup` steps."""
    import torch

    from trainer.model import build_model, loss_fn
    from trainer.site import pick_device

    if steps < 1 or warmup < 0:
        raise ValueError(f"bench_step: steps must be >= 1 and warmup >= 0, got {steps} and {warmup}")
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    device = pick_device(cfg)
    model = build_model(cfg.model, cfg.train.seed, device=device)
    t = cfg.train
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)
    autocast = device.type == "cuda" and t.bf16
    gen = torch.Generator().manual_seed(0)
    shape = (cfg.data.batch_size, cfg.data.seq_len + 1)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for i in range(warmup + steps):
        tokens = torch.randint(0, cfg.model.vocab_size, shape, generator=gen).to(device)
        sync()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "steps": steps,
            "warmup": warmup, "device": str(device), "threads": torch.get_num_threads(),
            "params": sum(p.numel() for p in model.parameters()),
            "tokens_per_step": cfg.data.batch_size * cfg.data.seq_len}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.probes.bench_step", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="trainer TOML (as `dilococtl launch` writes it)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    args = ap.parse_args(argv)
    from trainer.rules import config as config_mod

    try:
        cfg = config_mod.load(args.config)
        out = bench(cfg, steps=args.steps, warmup=args.warmup)
    except ValueError as e:  # ConfigError included
        print(json.dumps({"error": str(e)}), flush=True)
        return 2
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
