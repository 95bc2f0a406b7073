"""The outer optimizer's default lr and momentum as a function of H and the sync mode (no torch).

One rule, written once, used wherever the spec leaves `diloco.outer_lr` / `diloco.outer_momentum`
unset: by the trainer (trainer.outer.optimizer), the simulator, the outer service and the CLI's spec notes.
An explicit value in the spec always wins. The figures behind it: BENCHMARKS.md, "Quality of every
sync mode".
"""

from __future__ import annotations

import math

from trainer.rules.diloco_config import DilocoConfig

SHORT_RUN_ROUNDS = 5  # a run of at most this many outer rounds averages (lr 1, no momentum; async: α 0)
LONG_H = 500  # from this H on (in longer runs) the outer step is lr 1, Nesterov 0.3 (else 0.7, 0.5)
# where in the next round the update lands when no tune predicted the exchange (land_for has the figures)
UNTUNED_LAND = {"overlap": 0.05, "async": 0.1}


def default_outer_hparams(h: int, mode: str, rounds: int = 0) -> tuple[float, float]:
    """(lr, momentum) of the outer Nesterov SGD for H inner steps per round in `mode`, in a run of
    `rounds` outer rounds (0: not known, taken as many).

    Measured (BENCHMARKS.md, "Quality of every sync mode"; tiny preset, 2 sites, 1000 inner steps
    per site, H = 20, 100, 500): momentum 0.5 with lr 0.7 beat the paper's 0.9 at every H in every
    mode (sync 6.04/6.12/6.54 against 7.20/6.52/8.20 val ppl; overlap and async diverged with 0.9:
    up to 22.0 and 15.3), and came within 1-3% of the best other pair tried (lr 1, no momentum).
    0.9's steady step (lr/(1-μ) = 7x the pseudo-gradient) overshoots, and under staleness its
    momentum keeps pushing along an update that is already out of date: the paper's 0.9 pays only
    over hundreds of rounds, which the runs this tool sizes (tens of rounds at tune-h's H) do not
    reach. The rule is the same in every mode. Overlap also needs its update to
    land early (diloco.overlap_land); async keeps the dampening.

    Momentum needs rounds to pay: in a run of few rounds its carried-over part is a stale step
    that the run never recovers from. At H = 500 in a 1000-step run (2 rounds), lr 1 with no
    momentum (the sites' plain average) beat lr 0.7 / Nesterov 0.5 in sync on both seeds (6.299 vs
    6.541, 6.649 vs 6.862) and in overlap (6.411 vs 6.664); at 5 rounds it was 0.5% better (6.166
    vs 6.196), at 10 rounds 0.5% worse (6.145 vs 6.117), at 50 even. So sync and overlap runs of at
    most SHORT_RUN_ROUNDS rounds average (1, 0). So do async ones, with their dampening off
    (default_async_alpha): with the mid-round pull (trainer.modes.async_mode) at 2 rounds, 6.438 against
    the (0.7, 0.5) pair's 6.632 (seed 1: 6.726 vs 6.916); (1, 0) with the dampening on was 6.677.

    Past SHORT_RUN_ROUNDS the best pair depends on H (5000 inner steps per site, two seeds): at
    H = LONG_H (10 rounds) lr 1 with Nesterov 0.3 beat (0.7, 0.5) in sync (4.727 vs 4.780, 4.930 vs
    5.022) and overlap (4.751 vs 4.762, 4.953 vs 5.032), async mixed (4.763 vs 4.769, 4.986 vs
    4.943); at H = 250 the two pairs were even (one seed each way, within 0.8%), at H = 100 (0.7,
    0.5) was 0.3-0.5% better, and at H = 20 it was 5% better (4.706 vs 4.964): a pseudo-gradient of
    many inner steps is a step worth taking whole, one of few steps is noise that momentum averages.
    """
    if h <= 0:
        raise ValueError(f"H must be > 0, got {h}")
    if mode not in ("sync", "overlap", "async"):
        raise ValueError(f"mode must be sync, overlap or async, got {mode!r}")
    if rounds < 0:
        raise ValueError(f"rounds must be >= 0, got {rounds}")
    if 0 < rounds <= SHORT_RUN_ROUNDS:
        return 1.0, 0.0
    return (1.0, 0.3) if h >= LONG_H else (0.7, 0.5)


def default_async_alpha(rounds: int = 0) -> float:
    """α of async's staleness dampening 1/(1+αγ) in a run of `rounds` rounds (0: not known).

    With sites of equal speed the site that pushes second is always γ = K−1 = 1 behind, so α is a
    flat cut of its pushes. Over many rounds it pays (removing it hurt at H = 20: 6.491 vs 6.163,
    and at H = 500 before the mid-round pull); in a short run it only makes the average lopsided
    (at 2 rounds the first site's pushes count 1/2, the second's 1/3): with lr 1 and no momentum
    (the short-run pair) α 0 beat α 0.5 on both seeds (6.438 vs 6.677; and against the 0.7/0.5
    pair with α 0.5, 6.438 vs 6.632 and 6.726 vs 6.916).
    """
    if rounds < 0:
        raise ValueError(f"rounds must be >= 0, got {rounds}")
    return 0.0 if 0 < rounds <= SHORT_RUN_ROUNDS else 0.5


def async_alpha(cfg: DilocoConfig, rounds: int | None = None) -> float:
    """diloco.async_alpha, else the rule's for the run's rounds (None: diloco.rounds)."""
    if cfg.async_alpha is not None:
        return cfg.async_alpha
    return default_async_alpha(cfg.rounds if rounds is None else rounds)


def outer_hparams(cfg: DilocoConfig, rounds: int | None = None) -> tuple[float, float]:
    """(lr, momentum) of the outer SGD: localsgd's fixed pair, the spec's values, else the rule.

    `rounds`: the run's planned outer rounds (trainer.rules.schedule.planned_rounds, which counts
    train.steps); None takes diloco.rounds (async runs, which are sized in rounds only).
    """
    if cfg.algorithm == "localsgd":
        return 1.0, 0.0
    lr, momentum = default_outer_hparams(cfg.h, cfg.mode, cfg.rounds if rounds is None else rounds)
    return (lr if cfg.outer_lr is None else cfg.outer_lr,
            momentum if cfg.outer_momentum is None else cfg.outer_momentum)


def land_for(exchange_s: float, step_s: float, h: int) -> float:
    """The earliest landing (diloco.overlap_land, a fraction of H) that hides an exchange of
    `exchange_s` seconds behind inner steps of `step_s` seconds: its whole steps, at least 1, at most H.

    The later the update lands the staler the round it rebases on. On the small preset (H = 100,
    3000 steps per site, seeds 0-2) overlap landing 10% into the next round ended 1.022x / 1.009x /
    1.021x of sync's perplexity, landing at 5% 1.009x / 1.008x / 1.015x (BENCHMARKS.md, "Landing as
    early as the exchange allows"); a whole round late cost up to 1.2x. So a tuned run lands as soon
    as its predicted exchange is done (launch sets it from the tune made for the spec and H:
    dilococtl.tune.history.tuned_land). A run without a tune lands at UNTUNED_LAND: overlap at 5%, which hides
    an exchange of up to 5% of a round; async at 10%, since its one small-preset arm landing at 5%
    ended worse (seed 0: 1.038x of sync against 1.028x at 10%), though on the tiny preset 5% was better.
    """
    if not (math.isfinite(exchange_s) and exchange_s >= 0):
        raise ValueError(f"exchange time must be a finite number of seconds >= 0, got {exchange_s:g}")
    if not (math.isfinite(step_s) and step_s > 0):
        raise ValueError(f"step time must be a finite number of seconds > 0, got {step_s:g}")
    if h <= 0:
        raise ValueError(f"H must be > 0, got {h}")
    return max(1, min(h, math.ceil(exchange_s / step_s - 1e-9))) / h


def landing(cfg: DilocoConfig) -> float:
    """diloco.overlap_land, else UNTUNED_LAND of the mode."""
    return UNTUNED_LAND.get(cfg.mode, 1.0) if cfg.overlap_land is None else cfg.overlap_land


def land_step(h: int, land: float) -> int:
    """Overlap and async: the inner step of round t+1 after which round t's update lands (`landing`).

    `land` is a fraction of the round (1: at the round's end); at least 1 step, at most H.
    """
    return max(1, min(h, math.ceil(land * h - 1e-9)))
