"""What lying sites cost under each aggregation rule: final val ppl against the honest run.

    .venv/bin/python bench/byzantine.py [--rounds 12] [--h 20] [--sites 3,4,5,5x2]
        [--rules mean,filter,clip,median] [--attacks all] [--out bench/results/byzantine_3_4_5_5x2sites.json]

The simulator (trainer.simulate, sync mode, tiny preset) runs every site through the trainer's
own guard (trainer.outer.guard) over in-process comms. The liars are the last sites ("5x2": two liars
of five); they know every site's pseudo-gradient, as a colluding attacker would, and every round
send what the attack makes of it. Each figure is divided by the honest run of the same sites under
plain `mean`: 1.000 is no cost at all. A refused round is a round without an update.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.outer.aggregate import coordinate_median  # noqa: E402
from trainer.rules import config as config_mod  # noqa: E402
from trainer.simulate import simulate  # noqa: E402

Deltas = list[list[torch.Tensor]]


def _flat(ds: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([d.reshape(-1).float() for d in ds])


def _unflat(x: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, pos = [], 0
    for d in like:
        out.append(x[pos:pos + d.numel()].view_as(d).clone())
        pos += d.numel()
    return out


def _drift_direction(n: int) -> torch.Tensor:
    u = torch.randn(n, generator=torch.Generator().manual_seed(1234))
    return u / u.norm()


def attack(name: str, liars: int, ratio: float):
    """attack(round, deltas) -> (deltas, claimed weights): what the last `liars` sites send."""

    def run(r: int, deltas: Deltas) -> tuple[Deltas, list[float]]:
        k = len(deltas)
        honest = torch.stack([_flat(d) for d in deltas[:k - liars]])
        mu, sd = honest.mean(0), honest.std(0) if len(honest) > 1 else torch.zeros_like(honest[0])
        weights = [1.0] * k
        out = list(deltas)
        for j in range(k - liars, k):
            own = _flat(deltas[j])
            if name == "weight_lie":  # claim 1e6 votes and flip the update (a20f7d3: θ moved to -2.9)
                x, weights[j] = -2.9 * own, 1e6
            elif name == "norm_lie":  # a20f7d3: reported 2.99x, sent -14x
                x = -14 * own
            elif name == "sign_flip":
                x = -own
            elif name == "x10":
                x = 10 * own
            elif name == "x100":
                x = 100 * own
            elif name == "alie":  # a little is enough (Baruch et al. 2019): mean - z std, coordinate-wise
                x = mu - 1.0 * sd
            elif name == "ipm":  # inner-product manipulation (Xie et al. 2020): -eps x the honest mean
                x = -0.1 * mu
            elif name == "drift":  # a fixed direction, just inside the filter's bound every round
                c = coordinate_median(torch.stack([_flat(d) for d in deltas]))
                m = float((torch.stack([_flat(d) for d in deltas[:k - liars]]) - c).norm(dim=1).median())
                x = c + 0.95 * ratio * m * _drift_direction(c.numel())
            elif name == "nan":
                x = torch.full_like(own, math.nan)
            else:
                raise ValueError(f"unknown attack {name!r}")
            out[j] = _unflat(x, deltas[j])
        return out, weights

    return run


ATTACKS = ["weight_lie", "norm_lie", "sign_flip", "x10", "x100", "alie", "ipm", "drift", "nan"]


def run_one(sites: int, liars: int, rule: str, name: str | None, rounds: int, h: int, seed: int) -> dict:
    cfg = config_mod.from_dict({
        "model": {"preset": "tiny"}, "data": {"seq_len": 64, "batch_size": 8},
        "train": {"threads": 1, "eval_every": 0, "eval_batches": 8, "seed": seed},
        "diloco": {"sites": sites, "h": h, "rounds": rounds, "aggregate": rule}})
    t0 = time.perf_counter()
    res = simulate(cfg, attack=attack(name, liars, cfg.diloco.aggregate_clip_ratio) if name else None)
    ppl = res.rounds[-1].val_ppl
    refused = sum(1 for s, _ in res.rejected if s == "")
    return {"sites": sites, "liars": liars if name else 0, "rule": rule, "attack": name or "honest",
            "ppl": ppl if ppl is not None and math.isfinite(ppl) else None, "refused_rounds": refused,
            "rejections": len(res.rejected) - refused, "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--h", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sites", default="3,4,5,5x2", help="K, or KxL for L liars (default one)")
    ap.add_argument("--rules", default="mean,filter,clip,median")
    ap.add_argument("--attacks", default="all")
    ap.add_argument("--out", default="bench/results/byzantine_3_4_5_5x2sites.json")
    args = ap.parse_args()
    attacks = ATTACKS if args.attacks == "all" else args.attacks.split(",")
    rows: list[dict] = []
    out = Path(args.out)

    def done(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rows, indent=1))

    for spec in args.sites.split(","):
        k, _, l_ = spec.partition("x")
        sites, liars = int(k), int(l_ or 1)
        for rule in args.rules.split(","):
            done(run_one(sites, 0, rule, None, args.rounds, args.h, args.seed))
        # the best any defence can do: the honest sites alone
        floor = run_one(sites - liars, 0, "mean", None, args.rounds, args.h, args.seed)
        done({**floor, "sites": sites, "liars": liars, "attack": f"(the {sites - liars} honest sites alone)"})
        base = next(r["ppl"] for r in rows if r["sites"] == sites and r["attack"] == "honest" and r["rule"] == "mean")
        for name in attacks:
            for rule in args.rules.split(","):
                done(run_one(sites, liars, rule, name, args.rounds, args.h, args.seed))
        print(table([r for r in rows if r["sites"] == sites and r["liars"] in (0, liars)], base), flush=True)


def table(rows: list[dict], base: float) -> str:
    """Markdown: one line per attack, one column per rule, ppl / the honest mean run's."""
    rules = list(dict.fromkeys(r["rule"] for r in rows))
    head = f"| attack | {' | '.join(rules)} |\n| --- |{' ---: |' * len(rules)}"
    lines = [head]
    for name in dict.fromkeys(r["attack"] for r in rows):
        cells = []
        for rule in rules:
            r = next((x for x in rows if x["attack"] == name and x["rule"] == rule), None)
            if r is None:
                cells.append("")
            elif r["ppl"] is None:
                cells.append("diverged")
            else:
                cells.append(f"{r['ppl'] / base:.3f}" + (f" ({r['refused_rounds']} refused)" if r["refused_rounds"] else ""))
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
