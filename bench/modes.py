"""Quality of every sync mode at equal tokens: DDP, sync, overlap and async DiLoCo (a benchmark, not a test).

    nice -n 10 python3 bench/modes.py [--steps 1000] [--hs 20,100,500] [--modes ddp,sync,overlap,async]
        [--seeds 0] [--speeds 1,1] [--set diloco.outer_momentum=0.5 ...]

Every arm runs in the single-process simulator (trainer.simulate) with the same model, data order
and inner steps per site (`--steps`; rounds = steps / H), so every arm trains on the same tokens.
Only diloco.mode, diloco.h (and the --set overrides) differ. Outer lr and momentum are left unset
unless --set gives them, so the arms take trainer.outer.optimizer.default_outer_hparams(H, mode, rounds). Async
sites push in the order their relative speeds (--speeds) give. Prints a table (final val ppl,
ratio to DDP, ratio to sync at the same H) and writes JSON.
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
import tomllib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer.outer.optimizer import outer_hparams  # noqa: E402
from trainer.rules import config as config_mod  # noqa: E402
from trainer.rules.schedule import planned_rounds  # noqa: E402
from trainer.simulate import simulate  # noqa: E402


def parse_set(items: list[str]) -> dict[str, dict]:
    """--set SECTION.KEY=VALUE (VALUE in TOML syntax) -> nested overrides."""
    out: dict[str, dict] = {}
    for item in items:
        key, sep, value = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise SystemExit(f"error: --set {item!r}: expected SECTION.KEY=VALUE")
        out.setdefault(section, {})[name] = tomllib.loads(f"v = {value.strip()}")["v"]
    return out


def build_config(args: argparse.Namespace, mode: str, h: int, seed: int) -> config_mod.TrainerConfig:
    """The trainer config of one arm; arms differ only in mode, H and the seed."""
    doc = {
        "model": {"preset": args.preset},
        "data": {"seq_len": args.seq_len, "batch_size": args.batch},
        "train": {"lr": args.lr, "warmup_steps": args.warmup, "threads": args.threads, "seed": seed,
                  "eval_every": 0, "eval_batches": args.eval_batches},
        "diloco": {"sites": args.sites, "h": h, "rounds": args.steps // h,
                   **({"algorithm": "ddp"} if mode == "ddp" else {"mode": mode})},
    }
    for section, kv in args.overrides.items():
        if mode == "ddp" and section == "diloco":
            continue
        doc.setdefault(section, {}).update(kv)
    return config_mod.from_dict(doc)


def progress(arm: str, total_tokens: int, t0: float, every_s: float = 300.0):
    """A simulate() log that prints the arm's progress to stderr at most every `every_s` seconds:
    an arm of the small preset runs for an hour or more and says nothing otherwise."""
    last = t0

    def log(rec) -> None:
        nonlocal last
        now = time.perf_counter()
        if now - last < every_s:
            return
        last = now
        done = rec.tokens / total_tokens
        print(f"    {arm}: round {rec.round}, train loss {rec.train_loss:.3f}, {done:.0%} of the tokens "
              f"after {now - t0:.0f} s", file=sys.stderr, flush=True)
    return log


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}, torch {torch.__version__}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", help="model preset")
    ap.add_argument("--sites", type=int, default=2)
    ap.add_argument("--steps", type=int, default=1000, help="inner steps per site (every H must divide it)")
    ap.add_argument("--hs", default="20,100,500", help="comma list of H")
    ap.add_argument("--modes", default="ddp,sync,overlap,async", help="comma list; ddp runs once (no H)")
    ap.add_argument("--seeds", default="0", help="comma list of model seeds")
    ap.add_argument("--speeds", default="", help="async: relative site speeds (default: all 1)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="sequences per inner step per site")
    ap.add_argument("--lr", type=float, default=3e-3, help="inner AdamW peak lr (cosine to 10%%)")
    ap.add_argument("--warmup", type=int, default=20, help="warmup inner steps")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--eval-batches", type=int, default=16, help="validation batches")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="config override for every DiLoCo arm, e.g. diloco.outer_momentum=0.5 (repeatable)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "modes_tiny_1000_all_seed0.json"), help="JSON results ('' for none)")
    args = ap.parse_args(argv)
    args.overrides = parse_set(args.set)
    hs = [int(v) for v in args.hs.split(",") if v.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    seeds = [int(v) for v in args.seeds.split(",") if v.strip()]
    speeds = [float(v) for v in args.speeds.split(",")] if args.speeds else None
    bad = [h for h in hs if h <= 0 or args.steps % h]
    if bad:
        print(f"error: --hs: {bad} do not divide --steps {args.steps}", file=sys.stderr)
        return 2
    command = ("python3 bench/modes.py " + shlex.join(sys.argv[1:] if argv is None else argv)).rstrip()

    results = []
    for seed in seeds:
        for mode in modes:
            for h in ([args.steps] if mode == "ddp" else hs):
                cfg = build_config(args, mode, h, seed)
                lr, mom = outer_hparams(cfg.diloco, planned_rounds(cfg)) if mode != "ddp" else (0.0, 0.0)
                t0 = time.perf_counter()
                arm = f"seed {seed} {mode}" + ("" if mode == "ddp" else f" H={h}")
                res = simulate(cfg, speeds=speeds if mode == "async" else None,
                               log=progress(arm, args.steps * args.sites * args.batch * args.seq_len, t0))
                last = res.rounds[-1]
                row = {"seed": seed, "mode": mode, "h": None if mode == "ddp" else h, "outer_lr": lr,
                       "outer_momentum": mom, "tokens": last.tokens, "final_val_ppl": last.val_ppl,
                       "staleness_mean": sum(r.staleness for r in res.rounds) / len(res.rounds),
                       "wall_s": time.perf_counter() - t0}
                results.append(row)
                print(f"  seed {seed} {mode:<8} H={row['h'] or '-':<4} lr {lr:g} mom {mom:g}  tokens {row['tokens']}  "
                      f"val ppl {row['final_val_ppl']:.3f}  ({row['wall_s']:.0f} s)", file=sys.stderr, flush=True)

    def ppl(seed, mode, h=None):
        return next((r["final_val_ppl"] for r in results if r["seed"] == seed and r["mode"] == mode
                     and (mode == "ddp" or r["h"] == h)), None)

    for r in results:
        ddp, sync = ppl(r["seed"], "ddp"), ppl(r["seed"], "sync", r["h"])
        r["ratio_to_ddp"] = r["final_val_ppl"] / ddp if ddp else None
        r["ratio_to_sync"] = r["final_val_ppl"] / sync if sync and r["mode"] != "ddp" else None

    def f(v, fmt=".3f"):
        return format(v, fmt) if v is not None else "-"

    print("\n| seed | mode | H | outer lr | momentum | tokens | final val ppl | / ddp | / sync |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r['seed']} | {r['mode']} | {r['h'] or '-'} | {f(r['outer_lr'], 'g')} | "
              f"{f(r['outer_momentum'], 'g')} | {r['tokens']:,} | {r['final_val_ppl']:.3f} | "
              f"{f(r['ratio_to_ddp'])} | {f(r['ratio_to_sync'])} |")
    print(f"\ncommand: nice -n 10 {command}")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"benchmark": "modes", "date": datetime.date.today().isoformat(),
                                   "machine": machine(), "command": command, "speeds": speeds,
                                   "results": results}, indent=2) + "\n")
        print(f"results: {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
