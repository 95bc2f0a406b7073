"""Quality of DiLoCo against synchronous data parallel and Local SGD (a benchmark, not a test).

    nice -n 5 python3 bench/quality.py [--rounds 10] [--h 20] [--sites 2] [--algorithms diloco,ddp,localsgd]

Every algorithm runs in the single-process simulator (trainer.simulate) on the same config, data
order and token budget (sites x H x rounds x batch x seq_len tokens); only diloco.algorithm
differs. `ddp` averages gradients every inner step (one big cluster), `localsgd` averages
parameters every H steps (outer lr 1, no momentum), `diloco` takes Nesterov outer steps
(lr 0.7, momentum 0.9) on the averaged pseudo-gradient. The floor is an add-one bigram model fit
on the same training bytes and scored on the same held-out plays. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer.data import bigram_perplexity, load_tokens  # noqa: E402
from trainer.rules import config as config_mod  # noqa: E402
from trainer.rules.model_config import param_count  # noqa: E402
from trainer.simulate import simulate  # noqa: E402


def build_config(args: argparse.Namespace, algorithm: str) -> config_mod.TrainerConfig:
    """The trainer config of one benchmark arm; arms differ only in `algorithm`."""
    return config_mod.from_dict({
        "model": {"preset": args.preset},
        "data": {"seq_len": args.seq_len, "batch_size": args.batch},
        "train": {"lr": args.lr, "warmup_steps": args.warmup, "schedule": "cosine", "threads": args.threads,
                  "eval_every": args.eval_every, "eval_batches": args.eval_batches},
        "diloco": {"algorithm": algorithm, "sites": args.sites, "h": args.h, "rounds": args.rounds,
                   "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum},
    })


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}, torch {torch.__version__}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small", help="model preset (small: ~10.8M parameters)")
    ap.add_argument("--sites", type=int, default=2)
    ap.add_argument("--h", type=int, default=20, help="inner steps per outer round")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="sequences per inner step per site")
    ap.add_argument("--lr", type=float, default=3e-3, help="inner AdamW peak lr (cosine to 10%%)")
    ap.add_argument("--warmup", type=int, default=20, help="warmup inner steps")
    ap.add_argument("--outer-lr", type=float, default=0.7, help="diloco outer Nesterov lr (localsgd forces 1)")
    ap.add_argument("--outer-momentum", type=float, default=0.9, help="diloco outer momentum (localsgd forces 0)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--eval-every", type=int, default=2, help="rounds between validation passes")
    ap.add_argument("--eval-batches", type=int, default=16, help="validation batches per pass")
    ap.add_argument("--algorithms", default="diloco,ddp,localsgd", help="comma list, ddp is the reference")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "quality_small_10rounds.json"), help="JSON results ('' for none)")
    args = ap.parse_args(argv)
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    command = ("python3 bench/quality.py " + shlex.join(sys.argv[1:] if argv is None else argv)).rstrip()

    base = build_config(args, algorithms[0])
    corpus = load_tokens(base.data)
    floor = bigram_perplexity(corpus.train, corpus.val, corpus.vocab_size)
    params = param_count(base.model)
    print(f"model {args.preset} ({params / 1e6:.2f}M params), {args.sites} sites, H={args.h}, {args.rounds} rounds, "
          f"seq_len {args.seq_len}, batch {args.batch}/site, lr {args.lr:g}, warmup {args.warmup}", file=sys.stderr)
    print(f"byte-bigram floor on the held-out plays: {floor:.3f}", file=sys.stderr)

    results = []
    for alg in algorithms:
        cfg = build_config(args, alg)

        def log(rec, alg=alg):
            ppl = f"{rec.val_ppl:.3f}" if rec.val_ppl is not None else "-"
            print(f"  {alg:<8} round {rec.round:3d}  tokens {rec.tokens:>9}  train_loss {rec.train_loss:.4f}  "
                  f"val_ppl {ppl}", file=sys.stderr, flush=True)

        t0 = time.perf_counter()
        res = simulate(cfg, log=log)
        wall = time.perf_counter() - t0
        last = res.rounds[-1]
        results.append({"algorithm": alg, "rounds": last.round, "tokens": last.tokens, "final_val_ppl": last.val_ppl,
                        "wall_s": wall,
                        "curve": [{"round": r.round, "tokens": r.tokens, "train_loss": r.train_loss,
                                   "val_ppl": r.val_ppl} for r in res.rounds]})

    ref = next((r["final_val_ppl"] for r in results if r["algorithm"] == "ddp"), None)
    for r in results:
        r["ratio_to_ddp"] = r["final_val_ppl"] / ref if ref else None
        r["ratio_to_floor"] = r["final_val_ppl"] / floor

    print(f"\n{'algorithm':<10} {'rounds':>6} {'tokens':>10} {'val ppl':>8} {'/ ddp':>7} {'/ floor':>8} {'wall s':>7}")
    for r in results:
        ratio = f"{r['ratio_to_ddp']:.3f}" if r["ratio_to_ddp"] else "-"
        print(f"{r['algorithm']:<10} {r['rounds']:>6} {r['tokens']:>10} {r['final_val_ppl']:>8.3f} {ratio:>7} "
              f"{r['ratio_to_floor']:>8.3f} {r['wall_s']:>7.0f}")
    print(f"{'bigram':<10} {'':>6} {'':>10} {floor:>8.3f} {'':>7} {1:>8.3f} {'':>7}")
    print(f"\ncommand: {command}")

    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        doc = {"benchmark": "quality", "date": datetime.date.today().isoformat(), "machine": machine(),
               "command": command, "model_params": params, "bigram_floor": floor,
               "config": config_mod.to_dict(base) | {"diloco": {**config_mod.to_dict(base)["diloco"], "algorithm": "*"}},
               "results": results}
        out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"results: {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
