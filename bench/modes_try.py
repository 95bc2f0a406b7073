"""Variants of async mode tried in the simulator before any of them goes into the trainer (issue 16).

    nice -n 10 python3 bench/modes_try.py --variant NAME [bench/modes.py options]

Runs bench/modes.py with one change patched into the simulator's async loop (trainer.simulate):

- `eager`: eager restart (after Eager updates, arXiv 2502.12996). A push fresher than the K−1
  versions a round of K sites brings (γ < K−1) means the other sites' pushes of this round are not
  in θ yet; the site restarts from θ minus its own last step (lr_push · Δ_own) once for each such
  missing push, the local pseudo-gradient standing in for the others', and sends only its own
  progress since that restart (θ never holds the stand-in). A site's last round restarts on θ.
- `eager-count`: as `eager`, but a push's missing pushes are the other sites that have pushed fewer
  rounds than this site has (the service's per-site counts), not K−1−γ: with equal speeds the
  site that pushes first in every round restarts eagerly in every round, not only the first.
- `refresh`: (the second round's default, kept to show its arms ran on this code; the third round
  put the push itself behind compute, see trainer.simulate's run_async) a mid-round pull, as overlap lands its update (diloco.overlap_land, 10% unset): land_step(H)
  inner steps into each round the site pulls θ again and, if it moved, rebases on it keeping its own
  progress since the round began (trainer.outer.overlap_rebase); its push then carries that whole
  progress against the refreshed θ, whose version is its base (γ counts only pushes after it).
  Sites' pulls and pushes are ordered in time by their speeds (push j of site k at j/v_k, its
  refresh at (j − 1 + land/H)/v_k).
- `beyond`: the dampening 1/(1+α·max(0, γ−(K−1))): only staleness beyond what K sites of equal
  speed always have is dampened.
- `beyond+eager`: both.

Nothing here changes the trainer; a variant the measurements support is then built into
trainer.simulate and the async site together (`refresh` was). `eager` and `eager-count` replace
the whole async loop, so they run without the now-default mid-round pull; `beyond` patches only
the dampening and so runs with it. Results: BENCHMARKS.md, issue 16, second round.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import modes  # noqa: E402

from trainer import outer as outer_mod  # noqa: E402
from trainer import simulate as sim_mod  # noqa: E402
from trainer.outer_rule import landing  # noqa: E402
from trainer.simulate import arrival_order  # noqa: E402

VARIANTS = ("eager", "eager-count", "refresh", "beyond", "beyond+eager", "beyond+refresh")


def run_async_eager(self, speeds: Sequence[float], by_count: bool = False) -> None:
    """trainer.simulate._Sim.run_async with the eager restart (see the module doc)."""
    from trainer.param_service import encode_delta

    k = len(self.sites)
    rounds = self.cfg.diloco.rounds
    bases = [[g.detach().clone() for g in self.outer.params] for _ in range(k)]
    stand = [[torch.zeros_like(g) for g in self.outer.params] for _ in range(k)]  # e: restart = θ − e
    pulled, done, version = [0] * k, [0] * k, 0
    for n, i in enumerate(arrival_order(speeds, rounds), start=1):
        s = self.sites[i]
        losses: list[float] = []
        self.inner(s, losses)
        deltas = [b - e - p.detach().float() for b, e, p in zip(bases[i], stand[i], s.params, strict=True)]
        phases, decoded = encode_delta(self.comps[i], deltas)
        gamma = version - pulled[i]
        step = outer_mod.apply_push(self.outer, decoded, gamma)
        version += 1
        bases[i] = [g.detach().clone() for g in self.outer.params]
        pulled[i] = version
        done[i] += 1
        missing = (sum(done[j] < done[i] for j in range(k)) if by_count else max(0, k - 1 - gamma)) \
            if done[i] < rounds else 0
        stand[i] = [d * (missing * step.lr) for d in decoded]
        self.outer.copy_to(s.params)
        evaluate = n == k * rounds or (
            n % k == 0 and self.cfg.train.eval_every and (n // k) % self.cfg.train.eval_every == 0)
        self.record(done[i], losses, sum(len(b) for b in phases), bool(evaluate), s, staleness=gamma, site=i)
        with torch.no_grad():  # after the record: evaluation sees θ
            for p, e in zip(s.params, stand[i], strict=True):
                p.sub_(e.to(p.dtype))


def run_async_refresh(self, speeds: Sequence[float]) -> None:
    """trainer.simulate._Sim.run_async with a mid-round pull and rebase (see the module doc)."""
    from trainer.param_service import encode_delta

    k, rounds, h = len(self.sites), self.cfg.diloco.rounds, self.cfg.diloco.h
    land = outer_mod.land_step(h, landing(self.cfg.diloco))
    events = [(Fraction(j) / Fraction(v), i, 1) for i, v in enumerate(speeds) for j in range(1, rounds + 1)]
    if land < h:
        events += [(((j - 1) + Fraction(land, h)) / Fraction(v), i, 0) for i, v in enumerate(speeds)
                   for j in range(1, rounds + 1)]
    events.sort()
    bases = [[g.detach().clone() for g in self.outer.params] for _ in range(k)]  # θ each site last pulled
    starts = [[g.detach().clone() for g in self.outer.params] for _ in range(k)]  # its parameters at round start
    steps = [0] * k  # inner steps done in the current round
    losses: list[list[float]] = [[] for _ in range(k)]
    pulled, done, version, pushes = [0] * k, [0] * k, 0, 0
    for _, i, kind in events:
        s = self.sites[i]
        until = land if kind == 0 else h
        for _ in range(until - steps[i]):
            losses[i].append(s.inner_step()[0])
        steps[i] = until
        if kind == 0:  # the refresh: rebase on θ if it moved since this site pulled
            if version != pulled[i]:
                own = [a - p.detach().float() for a, p in zip(starts[i], s.params, strict=True)]
                outer_mod.overlap_rebase(s.params, self.outer.params, own)
                bases[i] = [g.detach().clone() for g in self.outer.params]
                pulled[i] = version
            continue
        deltas = [b - p.detach().float() for b, p in zip(bases[i], s.params, strict=True)]
        phases, decoded = encode_delta(self.comps[i], deltas)
        gamma = version - pulled[i]
        outer_mod.apply_push(self.outer, decoded, gamma)
        version += 1
        pushes += 1
        bases[i] = [g.detach().clone() for g in self.outer.params]
        starts[i] = [g.detach().clone() for g in self.outer.params]
        pulled[i] = version
        self.outer.copy_to(s.params)
        done[i] += 1
        steps[i] = 0
        evaluate = pushes == k * rounds or (
            pushes % k == 0 and self.cfg.train.eval_every and (pushes // k) % self.cfg.train.eval_every == 0)
        self.record(done[i], losses[i], sum(len(b) for b in phases), bool(evaluate), s, staleness=gamma, site=i)
        losses[i] = []


def patch(variant: str, sites: int) -> None:
    if variant == "eager-count":
        sim_mod._Sim.run_async = lambda self, speeds: run_async_eager(self, speeds, by_count=True)
    elif "eager" in variant:
        sim_mod._Sim.run_async = run_async_eager
    elif "refresh" in variant:
        sim_mod._Sim.run_async = run_async_refresh
    if "beyond" in variant:
        plain = outer_mod.dampening

        def beyond(gamma: int, alpha: float, kind: str = "inverse") -> float:
            return plain(max(0, gamma - (sites - 1)), alpha, kind)

        outer_mod.dampening = beyond


def main() -> int:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--variant", choices=VARIANTS, required=True)
    ap.add_argument("--sites", type=int, default=2)
    args, rest = ap.parse_known_args()
    patch(args.variant, args.sites)
    rc = modes.main(rest + ["--sites", str(args.sites)])
    out = Path(rest[rest.index("--out") + 1]) if "--out" in rest else ROOT / "bench" / "results" / "modes.json"
    if rc == 0 and out.name:  # the JSON names the command that made it, variant included
        doc = json.loads(out.read_text())
        doc["command"] = "python3 bench/modes_try.py " + shlex.join(sys.argv[1:])
        doc["variant"] = args.variant
        out.write_text(json.dumps(doc, indent=2) + "\n")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
