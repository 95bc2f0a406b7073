"""Single-process simulator of K DiLoCo sites: the reference the distributed trainer must equal.

    python -m trainer.simulate --config FILE [--sites K] [--rounds N] [--json]

It runs the same SiteTrainer, OuterState and Compressor code as the distributed trainer; the
exchange runs over a ThreadComm (one thread per site, sums in site order) instead of torchft.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field

import torch

from trainer import config as config_mod
from trainer.comm import ThreadComm, run_sites
from trainer.compression import Compressor
from trainer.config import TrainerConfig
from trainer.data import load_tokens, val_batches
from trainer.outer import OuterState
from trainer.site import SiteTrainer


@dataclass(kw_only=True, slots=True)
class SimRound:
    round: int  # 1-based
    train_loss: float  # mean inner loss over sites and steps
    val_loss: float | None  # after the outer step
    val_ppl: float | None
    bytes_sent: int  # per site, this round
    tokens: int  # all sites, so far


@dataclass(kw_only=True, slots=True)
class SimResult:
    rounds: list[SimRound] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)  # θ after the last round
    seconds: float = 0.0


def exchange(comps: list[Compressor], deltas: list[list[torch.Tensor]]) -> tuple[list[torch.Tensor], int]:
    """Every site runs its compressor's exchange in its own thread; returns (Δ̄, bytes sent per site)."""
    out = run_sites(ThreadComm.group(len(comps)), lambda k, comm: comps[k].average(deltas[k], comm, 1.0))
    avg, stats = out[0]
    return avg, stats.bytes_sent


def simulate(cfg: TrainerConfig, log=None) -> SimResult:
    """Run cfg.diloco.rounds rounds of K = cfg.diloco.sites sites; deterministic for a config."""
    t_start = time.perf_counter()
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    corpus = load_tokens(cfg.data)
    device = torch.device("cpu")
    k = cfg.diloco.sites
    sites = [SiteTrainer(cfg, corpus.train, i, device) for i in range(k)]
    outer = OuterState(sites[0].params, cfg.diloco)
    comps = [Compressor(spec=cfg.diloco.compression, error_feedback=cfg.diloco.error_feedback,
                        decay=cfg.diloco.error_feedback_decay, seed=cfg.train.seed, site=i,
                        options=cfg.diloco.codec_options()) for i in range(k)]
    vbatches = val_batches(corpus.val, cfg.data.seq_len, cfg.data.batch_size, cfg.train.eval_batches)
    result = SimResult()
    h = cfg.diloco.h
    pending = None  # overlap mode: the average still "in flight"
    for r in range(1, cfg.diloco.rounds + 1):
        losses = []
        sent = 0
        if cfg.diloco.algorithm == "ddp":
            for _ in range(h):
                for s in sites:
                    losses.append(s.forward_backward()[0])
                with torch.no_grad():
                    for gs in zip(*(s.grads() for s in sites), strict=True):
                        mean = torch.stack(gs).mean(0)
                        for g in gs:
                            g.copy_(mean)
                for s in sites:
                    s.update()
        elif cfg.diloco.mode == "overlap":
            # as trainer.loop.SiteRun.overlap_step: round t's average lands at the end of round t+1
            starts = [[p.detach().clone() for p in s.params] for s in sites]
            for s in sites:
                for _ in range(h):
                    losses.append(s.inner_step()[0])
            owns = [[a - p.detach() for a, p in zip(st, s.params, strict=True)] for st, s in zip(starts, sites, strict=True)]
            if pending is not None:
                outer.step(pending, k)
                with torch.no_grad():
                    for s, own in zip(sites, owns, strict=True):
                        for p, g, o in zip(s.params, outer.params, own, strict=True):
                            p.copy_(g.detach() - o)
            pending, sent = exchange(comps, owns)
            if r == cfg.diloco.rounds:
                outer.step(pending, k)
                for s in sites:
                    outer.copy_to(s.params)
        else:
            for s in sites:
                for _ in range(h):
                    losses.append(s.inner_step()[0])
            avg, sent = exchange(comps, [outer.deltas(s.params) for s in sites])
            outer.step(avg, k)
            for s in sites:
                outer.copy_to(s.params)
        evaluate = cfg.train.eval_every and (r % cfg.train.eval_every == 0) or r == cfg.diloco.rounds
        val = sites[0].evaluate(vbatches) if evaluate else None
        rec = SimRound(round=r, train_loss=sum(losses) / len(losses), val_loss=val,
                       val_ppl=math.exp(val) if val is not None else None, bytes_sent=sent,
                       tokens=sum(s.tokens for s in sites))
        result.rounds.append(rec)
        if log:
            log(rec)
    result.params = [p.detach().clone() for p in sites[0].params]
    result.seconds = time.perf_counter() - t_start
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.simulate", description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="trainer TOML (default: built-in defaults)")
    ap.add_argument("--sites", type=int, help="override diloco.sites")
    ap.add_argument("--rounds", type=int, help="override diloco.rounds")
    ap.add_argument("--h", type=int, help="override diloco.h")
    ap.add_argument("--preset", help="override model.preset")
    ap.add_argument("--algorithm", choices=["diloco", "localsgd", "ddp"], help="override diloco.algorithm")
    ap.add_argument("--compression", help="override diloco.compression")
    ap.add_argument("--json", action="store_true", help="print the rounds as JSON on stdout")
    args = ap.parse_args(argv)
    try:
        cfg = config_mod.load(args.config) if args.config else config_mod.from_dict({})
        d = cfg.diloco
        over = {k: v for k, v in (("sites", args.sites), ("rounds", args.rounds), ("h", args.h),
                                  ("algorithm", args.algorithm), ("compression", args.compression)) if v}
        d = dataclasses.replace(d, **over)
        model = dataclasses.replace(cfg.model, preset=args.preset) if args.preset else cfg.model
        if args.preset:
            model = config_mod.ModelConfig(preset=args.preset)
        cfg = config_mod.validate(dataclasses.replace(cfg, diloco=d, model=model))
    except (config_mod.ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    def log(rec: SimRound) -> None:
        ppl = f"{rec.val_ppl:.3f}" if rec.val_ppl is not None else "-"
        print(f"round {rec.round:4d}  train_loss {rec.train_loss:.4f}  val_ppl {ppl}  "
              f"bytes/site {rec.bytes_sent}", file=sys.stderr)

    res = simulate(cfg, log=log)
    if args.json:
        json.dump({"rounds": [dataclasses.asdict(r) for r in res.rounds], "seconds": res.seconds},
                  sys.stdout, indent=2)
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
