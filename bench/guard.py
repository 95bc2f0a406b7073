"""What the pseudo-gradient guard costs when every site is honest, and what it saves when one is not.

    .venv/bin/python bench/guard.py [--rounds 30] [--h 20] [--every 3]

Three simulated sites (trainer.simulate, sync mode, tiny preset). Site 2 sends, every `--every`
rounds, either its pseudo-gradient times 100 or NaN; each case runs with the guard
(trainer.outer.guard, diloco.guard_norm_ratio 3, the default) and without it: the plain compressed
average the exchange ran before the guard, where a NaN contribution raises NonFiniteDelta.
"""

from __future__ import annotations

import argparse
import math

import torch

from trainer import simulate as sim_mod
from trainer.codecs.compression import NonFiniteDelta
from trainer.outer.guard import GuardedAverage, guarded_average
from trainer.rules import config as config_mod
from trainer.simulate import simulate


def unguarded(comp, deltas, comm, weight, site, rule, extra=(), tokens=0.0):
    """The exchange before the guard: every contribution averaged as sent."""
    avg, stats = comp.average(deltas, comm, weight)
    return GuardedAverage(avg=avg, stats=stats, k_active=comm.size, weights=[weight] * comm.size, rows=[],
                          names=[], rejected=[])


def run(rounds: int, h: int, guard: bool, poison, seed: int = 0) -> tuple[str, int]:
    cfg = config_mod.from_dict({
        "model": {"preset": "tiny"}, "data": {"seq_len": 64, "batch_size": 8},
        "train": {"threads": 1, "eval_every": 0, "eval_batches": 8, "seed": seed},
        "diloco": {"sites": 3, "h": h, "rounds": rounds}})
    sim_mod.guarded_average = guarded_average if guard else unguarded
    try:
        res = simulate(cfg, poison=poison)
    except (NonFiniteDelta, RuntimeError) as e:
        return f"fails ({type(e).__name__})", 0
    ppl = res.rounds[-1].val_ppl
    return (f"{ppl:.3f}" if ppl is not None and math.isfinite(ppl) else str(ppl)), len(res.rejected)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--h", type=int, default=20)
    ap.add_argument("--every", type=int, default=3, help="rounds between site 2's bad pseudo-gradients")
    args = ap.parse_args()

    def bad(kind):
        def poison(r, k, deltas):
            if k != 2 or r % args.every:
                return deltas
            return [d * 100 for d in deltas] if kind == "100x" else [torch.full_like(d, math.nan) for d in deltas]
        return poison

    print("| case | final val ppl, guard | contributions rejected | final val ppl, no guard |\n| --- | --- | --- | --- |")
    for name, poison in (("honest", None), ("site 2 sends 100x", bad("100x")), ("site 2 sends NaN", bad("nan"))):
        on, n = run(args.rounds, args.h, True, poison)
        off, _ = run(args.rounds, args.h, False, poison)
        print(f"| {name} | {on} | {n} | {off} |", flush=True)


if __name__ == "__main__":
    main()
