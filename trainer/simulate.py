"""Single-process simulator of K DiLoCo sites: the reference the distributed trainer must equal.

    python -m trainer.simulate --config FILE [--sites K] [--rounds N] [--mode M] [--speeds 1,2] [--json]

It runs the same SiteTrainer, OuterState and Compressor code as the distributed trainer, in every
mode: `ddp` (gradients averaged every step), `sync`, `overlap` (round t's average lands at the end
of round t+1: staleness 1) and `async` (each push applied on arrival by trainer.outer.optimizer.apply_push,
as the outer service does; a site pulls θ again land_step inner steps into its round and rebases
on it, as overlap lands its update). The sync exchange runs over a ThreadComm (one thread per site, sums in
site order) instead of torchft. In async mode the sites' relative speeds fix the order in which
their pushes arrive (`arrival_order`), so staleness follows from the speed ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import torch

from trainer.codecs.compression import Compressor
from trainer.collectives import ThreadComm, run_sites
from trainer.data import load_tokens, val_batches
from trainer.outer.guard import GuardRule, guarded_average
from trainer.outer.optimizer import OuterState, apply_push, overlap_rebase
from trainer.rules import config as config_mod
from trainer.rules.codec_spec import is_sparse
from trainer.rules.config import TrainerConfig
from trainer.rules.diloco_config import DilocoConfig
from trainer.rules.fragments import compressor, offsets, split
from trainer.rules.model_config import ModelConfig
from trainer.rules.outer_rule import land_step, landing
from trainer.rules.schedule import planned_rounds, round_h, run_over
from trainer.rules.tables import ConfigError
from trainer.site import SiteTrainer


@dataclass(kw_only=True, slots=True)
class SimRound:
    round: int  # 1-based; in async mode one record per push (K records per round of every site)
    train_loss: float  # mean inner loss over the sites and steps of this record
    val_loss: float | None  # after the outer step
    val_ppl: float | None
    bytes_sent: int  # per site, this round
    tokens: int  # all sites, so far
    staleness: int = 0  # versions (async) or rounds (overlap) between the θ a delta was computed on and its application
    site: int = -1  # async: the site that pushed
    peak_bytes: int = 0  # per site, the largest single exchange of this record (diloco.fragments: one fragment's)


@dataclass(kw_only=True, slots=True)
class SimResult:
    rounds: list[SimRound] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)  # θ after the last round
    seconds: float = 0.0
    rejected: list[tuple[str, str]] = field(default_factory=list)  # the guard's (site, reason), in order


# what a site sends in place of its pseudo-gradient: poison(round, site, deltas) -> deltas (fault studies)
Poison = Callable[[int, int, list[torch.Tensor]], list[torch.Tensor]]
# what colluding liars send, knowing every site's pseudo-gradient: attack(round, deltas) -> (deltas,
# claimed weights) (bench/byzantine.py)
Attack = Callable[[int, list[list[torch.Tensor]]], tuple[list[list[torch.Tensor]], list[float]]]


def exchange(comps: list[Compressor], deltas: list[list[torch.Tensor]], d: DilocoConfig | None = None,
             rejected: list[tuple[str, str]] | None = None, weights: Sequence[float] = ()
             ) -> tuple[list[torch.Tensor] | None, int, int]:
    """Every site runs the trainer's guarded exchange (trainer.outer.guard) in its own thread; returns
    (Δ̄, bytes sent per site, sites in the average); Δ̄ is None for a round the guard refused (with
    `d` given; without, that raises). `rejected` collects the guard's (site, reason), a refused
    round as ("", reason). `weights`: what each site claims (default 1)."""
    rule = GuardRule.of(d, sparse=is_sparse(d.compression)) if d is not None else GuardRule(norm_ratio=0.0)
    out = run_sites(ThreadComm.group(len(comps)), lambda k, comm: guarded_average(
        comps[k], deltas[k], comm, weights[k] if weights else 1.0, f"site{k}", rule))
    if rejected is not None:
        rejected.extend(out[0].rejected)
        if out[0].failed:
            rejected.append(("", out[0].failed))
    if out[0].failed or out[0].avg is None:
        if d is None:
            raise RuntimeError(out[0].failed or "no site contributed")
        return None, out[0].stats.bytes_sent if out[0].stats else 0, 0  # not committed: the round is lost
    return out[0].avg, out[0].stats.bytes_sent, out[0].k_active


def arrival_times(speeds: Sequence[float], rounds: int, offset: Fraction = Fraction(0)) -> list[tuple[Fraction, int]]:
    """(time, site) of every site's j-th event, j = 1..rounds, at (j + offset) / speeds[k], in time
    order (equal times: the lower site index first). offset 0: the pushes."""
    if not speeds or any(not (math.isfinite(v) and v > 0) for v in speeds):
        raise ValueError(f"site speeds must be finite and > 0, got {list(speeds)}")
    return sorted(((j + offset) / Fraction(v), k) for k, v in enumerate(speeds) for j in range(1, rounds + 1))


def arrival_order(speeds: Sequence[float], rounds: int) -> list[int]:
    """The site of every async push, in the order the service receives them.

    Site k pushes its j-th delta at time j / speeds[k] (a site twice as fast pushes twice as
    often); equal times go to the lower site index. Every site pushes `rounds` times.
    """
    return [k for _, k in arrival_times(speeds, rounds)]


class _Sim:
    """State shared by the modes: the sites, θ and the outer optimizer, the codecs, the records."""

    def __init__(self, cfg: TrainerConfig, log: Callable[[SimRound], None] | None, poison: Poison | None = None,
                 attack: Attack | None = None):
        self.cfg = cfg
        self.log = log
        corpus = load_tokens(cfg.data)
        k = cfg.diloco.sites
        self.sites = [SiteTrainer(cfg, corpus.train, i, torch.device("cpu")) for i in range(k)]
        self.outer = OuterState(self.sites[0].params, cfg.diloco, planned_rounds(cfg))
        # diloco.fragments: the parameter indices of each fragment, each with its own codec state per site
        self.frags = split([p.numel() for p in self.sites[0].params], cfg.diloco.fragments)
        self.frag_comps = [[compressor(cfg.diloco, cfg.train.seed, i, f) for i in range(k)]
                           for f in range(len(self.frags))]
        self.comps = self.frag_comps[0]  # unfragmented modes (and F = 1): the sites' one codec each
        # overlap: each site's parameters after its last send of each fragment, whether that fragment's
        # update has landed since (then its next send is taken against θ), and the exchange in flight
        self.starts = [[p.detach().clone() for p in s.params] for s in self.sites]
        self.rebased = [False] * len(self.frags)
        self.pending: tuple[int, list[torch.Tensor], int] | None = None  # (fragment, Δ̄, sites in it)
        self.vbatches = val_batches(corpus.val, cfg.data.seq_len, cfg.data.batch_size, cfg.train.eval_batches)
        self.result = SimResult()
        self.poison: Poison = poison or (lambda r, k, deltas: deltas)
        self.attack: Attack = attack or (lambda r, deltas: (deltas, [1.0] * len(deltas)))
        self.rejected: list[tuple[str, str]] = []  # the guard's decisions, in round order

    def inner(self, site: SiteTrainer, losses: list[float], h: int | None = None) -> None:
        for _ in range(self.cfg.diloco.h if h is None else h):
            losses.append(site.inner_step()[0])

    @property
    def steps_done(self) -> int:
        """Inner steps per site so far (every site of a sync, overlap or DDP run has done as many)."""
        return self.sites[0].step

    def last(self, r: int) -> bool:
        """Whether round r, just run, ended the run (trainer.modes.loop's test: train.steps, else rounds)."""
        return run_over(r, self.steps_done, self.cfg)

    def record(self, r: int, losses: list[float], sent: int, evaluate: bool, on: SiteTrainer,
               staleness: int = 0, site: int = -1, peak: int | None = None) -> None:
        val = None
        if evaluate and len(self.frags) > 1:  # fragments: a site's own parameters mix θ and local progress
            with self.outer.installed(on.params):
                val = on.evaluate(self.vbatches)
        elif evaluate:
            val = on.evaluate(self.vbatches)
        rec = SimRound(round=r, train_loss=sum(losses) / len(losses), val_loss=val,
                       val_ppl=math.exp(val) if val is not None else None, bytes_sent=sent,
                       tokens=sum(s.tokens for s in self.sites), staleness=staleness, site=site,
                       peak_bytes=sent if peak is None else peak)
        self.result.rounds.append(rec)
        if self.log:
            self.log(rec)

    def due(self, r: int) -> bool:
        every = self.cfg.train.eval_every
        return bool(every and r % every == 0) or self.last(r)

    def ddp_round(self, r: int, h: int) -> None:
        losses: list[float] = []
        for _ in range(h):
            for s in self.sites:
                losses.append(s.forward_backward()[0])
            with torch.no_grad():
                for gs in zip(*(s.grads() for s in self.sites), strict=True):
                    mean = torch.stack(gs).mean(0)
                    for g in gs:
                        g.copy_(mean)
            for s in self.sites:
                s.update()
        self.record(r, losses, 0, self.due(r), self.sites[0])

    def advance(self, losses: list[float], steps: int) -> None:
        """`steps` more inner steps at every site, site after site."""
        for s in self.sites:
            self.inner(s, losses, steps)

    def send(self, r: int, f: int, deltas: list[list[torch.Tensor]]) -> int:
        """Fragment f's guarded exchange of the sites' `deltas`; returns the bytes sent per site and
        keeps the outcome for the caller to apply (`self.pending`; a refused round: nothing)."""
        deltas, weights = self.attack(r, [self.poison(r, k, x) for k, x in enumerate(deltas)])
        avg, sent, k_active = exchange(self.frag_comps[f], deltas, self.cfg.diloco, self.rejected, weights)
        self.pending = (f, avg, k_active) if avg is not None else None
        return sent

    def sync_round(self, r: int, h: int) -> None:
        """Each fragment, after its inner step of the round (trainer.rules.fragments.offsets; one fragment: all
        of them after step h): its exchange, its outer step, and every site restarts it from θ."""
        losses: list[float] = []
        sent, peak, done = 0, 0, 0
        for f, at in enumerate(offsets(h, len(self.frags))):
            self.advance(losses, at - done)
            done, idx = at, self.frags[f]
            n = self.send(r, f, [self.outer.deltas(s.params, idx) for s in self.sites])
            sent, peak = sent + n, max(peak, n)
            if self.pending is not None:
                self.outer.step(self.pending[1], self.pending[2], idx)
                self.pending = None
            for s in self.sites:
                self.outer.copy_to(s.params, idx)
        if self.last(r) and len(self.frags) > 1:  # the run ends on θ_final (the last fragments' progress since their exchange is dropped)
            for s in self.sites:
                self.outer.copy_to(s.params)
        self.record(r, losses, sent, self.due(r), self.sites[0], peak=peak)

    def land(self) -> None:
        """The exchange in flight lands: its outer step, and every site rebases that fragment on θ keeping
        its own progress since it sent it."""
        assert self.pending is not None
        f, avg, k_active = self.pending
        idx, self.pending = self.frags[f], None
        owns = [[a - s.params[i].detach() for a, i in zip(st_f, idx, strict=True)]
                for st_f, s in zip(([st[i] for i in idx] for st in self.starts), self.sites, strict=True)]
        self.outer.step(avg, k_active, idx)
        for s, own in zip(self.sites, owns, strict=True):
            overlap_rebase([s.params[i] for i in idx], [self.outer.params[i] for i in idx], own,
                           self.cfg.diloco.overlap_mix)
        self.rebased[f] = True

    def overlap_round(self, r: int, h: int) -> None:
        """As the distributed overlap exchange: each exchange (one per fragment) runs while the sites compute
        and lands `land_step` of the way to the next exchange point (one fragment: into the next round, at its
        end by default), at the latest just before the next exchange starts; the sites rebase that fragment
        on it and keep their own progress. A fragment's send is its progress since its last send, taken
        against θ once its update has landed."""
        losses: list[float] = []
        sent, peak, done, prev = 0, 0, 0, 0
        for f, at in enumerate(offsets(h, len(self.frags))):
            land_at = None
            if self.pending is not None:  # lands land_step of the way from the previous exchange point to this one
                land_at = prev + (land_step(at - prev, landing(self.cfg.diloco)) if at > prev else 0)
                if land_at < at:
                    self.advance(losses, land_at - done)
                    done = land_at
                    self.land()
            self.advance(losses, at - done)
            done, prev, idx = at, at, self.frags[f]
            if self.rebased[f]:  # landed mid-round: the progress since is measured against θ_{t+1}
                deltas = [self.outer.deltas(s.params, idx) for s in self.sites]
            else:
                deltas = [[st[i] - s.params[i].detach() for i in idx] for st, s in zip(self.starts, self.sites, strict=True)]
            if self.pending is not None:  # lands now, just before this exchange starts
                self.land()
            n = self.send(r, f, deltas)
            sent, peak = sent + n, max(peak, n)
            for st, s in zip(self.starts, self.sites, strict=True):
                for i in idx:
                    st[i] = s.params[i].detach().clone()
            self.rebased[f] = False
        if self.last(r):  # the last exchange is waited for: the run ends on θ_final
            if self.pending is not None:
                self.land()
            for s in self.sites:
                self.outer.copy_to(s.params)
        self.record(r, losses, sent, self.due(r), self.sites[0], staleness=1 if r > 1 else 0, peak=peak)

    def run_async(self, speeds: Sequence[float]) -> None:
        """Pushes in arrival order, each applied at once by apply_push.

        As the distributed async site (trainer.modes.async_mode): a site pushes at the end of a round and
        goes on computing; land_step(H, diloco.overlap_land) inner steps into the next round it
        rebases on the newest θ keeping its own progress since the round began (overlap_rebase), and
        its next push carries its whole round's progress against that θ, whose version is its base.
        With overlap_land 1 it rebases just before its next push. Push j of site k happens at time
        j / speeds[k], its landing at (j − 1 + land / H) / speeds[k]; equal times go to the lower
        site index. A site's last push, and every push with diloco.async_turns, is waited for: the
        site then continues from θ as its push left it.
        """
        from trainer.service.param_service import encode_delta  # the async wire path (no torch.distributed)

        k, rounds, h = len(self.sites), self.cfg.diloco.rounds, self.cfg.diloco.h
        turns = self.cfg.diloco.async_turns
        land = h if turns else land_step(h, landing(self.cfg.diloco))
        pushes = arrival_times(speeds, rounds)
        lands = arrival_times(speeds, rounds, Fraction(land, h) - 1) if land < h else []
        events = sorted([(t, i, True) for t, i in pushes] + [(t, i, False) for t, i in lands])
        bases = [[g.detach().clone() for g in self.outer.params] for _ in range(k)]  # θ each site rebased on
        starts = [[g.detach().clone() for g in self.outer.params] for _ in range(k)]  # its round's start
        pulled = [0] * k  # the version of that θ
        in_flight = [False] * k  # a push out whose θ has not landed
        done = [0] * k  # rounds each site completed
        steps = [0] * k  # inner steps of its current round each site has done
        losses: list[list[float]] = [[] for _ in range(k)]
        version = 0

        def rebase(i: int) -> None:
            s = self.sites[i]
            own = [a - p.detach().float() for a, p in zip(starts[i], s.params, strict=True)]
            overlap_rebase(s.params, self.outer.params, own)
            bases[i] = [g.detach().clone() for g in self.outer.params]
            pulled[i] = version
            in_flight[i] = False

        for _, i, push in events:
            s = self.sites[i]
            until = h if push else land
            self.inner(s, losses[i], until - steps[i])
            steps[i] = until
            if not push:  # the landing: rebase on the newest θ, keeping this round's progress
                if in_flight[i]:
                    rebase(i)
                continue
            if in_flight[i]:  # overlap_land 1: the update lands just before the next push
                rebase(i)
            deltas = [b - p.detach().float() for b, p in zip(bases[i], s.params, strict=True)]
            phases, decoded = encode_delta(self.comps[i], deltas)
            gamma = version - pulled[i]
            apply_push(self.outer, decoded, gamma)
            version += 1
            done[i] += 1
            steps[i] = 0
            if turns or done[i] == rounds:  # waited for: continue from θ as this push left it
                self.outer.copy_to(s.params)
                bases[i] = [g.detach().clone() for g in self.outer.params]
                pulled[i] = version
            else:
                in_flight[i] = True
            starts[i] = [p.detach().float().clone() for p in s.params]
            # evaluate when every site's round r is in (the last pusher's parameters are then θ_final)
            evaluate = version == k * rounds or (
                version % k == 0 and self.cfg.train.eval_every and (version // k) % self.cfg.train.eval_every == 0)
            self.record(done[i], losses[i], sum(len(b) for b in phases), bool(evaluate), s, staleness=gamma, site=i)
            losses[i] = []


def simulate(cfg: TrainerConfig, log: Callable[[SimRound], None] | None = None,
             speeds: Sequence[float] | None = None, poison: Poison | None = None,
             attack: Attack | None = None) -> SimResult:
    """Run K = cfg.diloco.sites sites in cfg's mode for the run's length, as trainer.modes.loop does:
    cfg.train.steps inner steps per site when set (the last round cut to fit), else cfg.diloco.rounds
    rounds (async: always rounds, pushes per site); deterministic for a config.

    `speeds` (async mode): each site's relative inner-step rate (default: all equal); it fixes the
    order of the pushes (`arrival_order`) and so their staleness.
    """
    t_start = time.perf_counter()
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    d = cfg.diloco
    if speeds is not None and len(speeds) != d.sites:
        raise ValueError(f"{len(speeds)} site speeds given for {d.sites} sites")
    sim = _Sim(cfg, log, poison, attack)
    if d.algorithm != "ddp" and d.mode == "async":
        # taking turns, pushes arrive in site order whatever the sites' speeds
        sim.run_async([1.0] * d.sites if d.async_turns or not speeds else speeds)
    else:
        # as trainer.modes.loop: rounds of H until the run's inner steps are done (train.steps cuts the
        # last round short), else diloco.rounds rounds; H stays fixed here (h_auto adapts it to
        # timings the simulator does not have)
        r = 0
        while not run_over(r, sim.steps_done, cfg):
            r += 1
            h = round_h(d.h, sim.steps_done, cfg)
            if d.algorithm == "ddp":
                sim.ddp_round(r, h)
            elif d.mode == "overlap":
                sim.overlap_round(r, h)
            else:
                sim.sync_round(r, h)
    sim.result.params = [g.detach().clone() for g in sim.outer.params] if d.algorithm != "ddp" \
        else [p.detach().clone() for p in sim.sites[0].params]
    sim.result.seconds = time.perf_counter() - t_start
    sim.result.rejected = sim.rejected
    return sim.result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.simulate", description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="trainer TOML (default: built-in defaults)")
    ap.add_argument("--sites", type=int, help="override diloco.sites")
    ap.add_argument("--rounds", type=int, help="override diloco.rounds")
    ap.add_argument("--h", type=int, help="override diloco.h")
    ap.add_argument("--preset", help="override model.preset")
    ap.add_argument("--algorithm", choices=["diloco", "localsgd", "ddp"], help="override diloco.algorithm")
    ap.add_argument("--compression", help="override diloco.compression")
    ap.add_argument("--mode", choices=["sync", "overlap", "async"], help="override diloco.mode")
    ap.add_argument("--fragments", type=int, help="override diloco.fragments (Streaming DiLoCo)")
    ap.add_argument("--speeds", help="async: relative site speeds, comma-separated (default: all 1)")
    ap.add_argument("--json", action="store_true", help="print the rounds as JSON on stdout")
    args = ap.parse_args(argv)
    try:
        cfg = config_mod.load(args.config) if args.config else config_mod.from_dict({})
        d = cfg.diloco
        over = {k: v for k, v in (("sites", args.sites), ("rounds", args.rounds), ("h", args.h),
                                  ("algorithm", args.algorithm), ("compression", args.compression),
                                  ("mode", args.mode)) if v}
        if args.fragments is not None:
            over["fragments"] = args.fragments
        d = dataclasses.replace(d, **over)
        model = dataclasses.replace(cfg.model, preset=args.preset) if args.preset else cfg.model
        if args.preset:
            model = ModelConfig(preset=args.preset)
        cfg = config_mod.validate(dataclasses.replace(cfg, diloco=d, model=model))
        speeds = [float(v) for v in args.speeds.split(",")] if args.speeds else None
        if speeds is not None:
            arrival_order(speeds, 1)  # bad speeds fail here, before any training
            if len(speeds) != cfg.diloco.sites:
                raise ValueError(f"--speeds: {len(speeds)} speeds for {cfg.diloco.sites} sites")
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    def log(rec: SimRound) -> None:
        ppl = f"{rec.val_ppl:.3f}" if rec.val_ppl is not None else "-"
        who = f"  site {rec.site} staleness {rec.staleness}" if rec.site >= 0 else ""
        peak = f"  peak {rec.peak_bytes}" if rec.peak_bytes != rec.bytes_sent else ""
        print(f"round {rec.round:4d}  train_loss {rec.train_loss:.4f}  val_ppl {ppl}  "
              f"bytes/site {rec.bytes_sent}{peak}{who}", file=sys.stderr)

    res = simulate(cfg, log=log, speeds=speeds)
    if args.json:
        json.dump({"rounds": [dataclasses.asdict(r) for r in res.rounds], "seconds": res.seconds},
                  sys.stdout, indent=2)
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
