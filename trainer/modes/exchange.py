"""The outer exchange's interface: what a round's exchange returns, and what every mode implements.

A round of the trainer is one pipeline (trainer.modes.loop): compute H inner steps, exchange, finish the
round. The modes differ only in the exchange, so each is one class:

- `SyncExchange`, `OverlapExchange`, `DdpExchange` (trainer.modes.ft_exchange): over torchft's quorum;
- `AsyncExchange` (trainer.modes.async_mode): against the outer parameter service.

A new mode or transport is one more class, not another copy of the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from trainer.codecs.compression import Compressor
from trainer.outer.optimizer import OuterState
from trainer.rules.config import TrainerConfig
from trainer.site import SiteTrainer

GradHook = Callable[[list[torch.Tensor]], None]


class Preempted(Exception):
    """SIGTERM arrived: the loop stopped at a safe point."""


@dataclass(kw_only=True, slots=True)
class ExchangeResult:
    """What one round's exchange did, whatever the mode."""

    sync_s: float = 0.0  # wall seconds the site spent in the exchange that compute did not hide
    k_active: int = 0  # sites whose contribution the applied update averaged
    committed: bool = False  # the round was committed (torchft's vote; the service took the push)
    applied: bool = False  # an outer update reached θ this round
    outer_lr: float = 0.0  # effective outer lr of the applied update (after elastic scaling, dampening)
    bytes_sent: int = 0  # payload bytes this site put on the WAN
    bytes_recv: int = 0  # payload bytes this site received
    exchange_bytes: tuple[int, ...] = ()  # payload bytes sent by each exchange of the round (diloco.fragments: F)
    staleness: int = 0  # rounds between the θ the delta was computed on and its application
    h_next: int | None = None  # h_auto: the H every site agreed on for the next round (None: keep)
    window_s: float = 0.0  # h_policy "time": the compute window every site agreed on for the next round (0: none)
    rejected: tuple[str, ...] = ()  # sites whose contribution was refused this round
    exchange_t: float | None = None  # the parts of the exchange, and when it began
    quorum_s: float | None = None  # (trainer.records.RoundRecord has their meaning)
    weight_s: float | None = None
    payload_s: float | None = None


class Metrics(Protocol):
    def write(self, rec: Any) -> None: ...

    def event(self, kind: str, message: str, **detail: Any) -> None: ...


class RoundContext(Protocol):
    """The parts of a site's run an exchange reads and moves (trainer.modes.loop.SiteRun has them)."""

    cfg: TrainerConfig
    rank: int  # this process's rank inside the site
    world: int  # processes in the site
    device: torch.device
    site: SiteTrainer
    outer: OuterState  # θ_t and the outer optimizer
    comp: Compressor  # fragment 0's (the only one without diloco.fragments)
    comps: list[Compressor]  # each fragment's codec
    frags: list[list[int]]  # each fragment's parameter indices (trainer.rules.fragments.split)
    fragment: int  # the fragment whose exchange is under way, else the next one due
    step_tokens: int  # tokens the site trains in one inner step
    metrics: Metrics
    manager: Any  # torchft Manager (None in async mode)
    timeout: Any  # datetime.timedelta: the exchange's collective timeout
    round: int  # rounds completed
    h: int  # inner steps of the current round
    h_done: int  # inner steps done in the current round
    healed: bool  # set by the heal callback during a quorum
    last_sync: tuple[float, float]  # h_auto, h_policy "time": this site's last (sync_s, step_s)
    round_tokens: float  # tokens this site trained in the round just computed
    contributing: bool  # in an exchange that sends this site's round
    late: Any  # diloco.late_merge: trainer.modes.loop.LateRound, the round the quorum went on without
    resumed_from: int | None  # round of the checkpoint this process started from
    stop_requested: bool


class Exchange:
    """One mode's exchange. The pipeline calls, per run: join; per round: begin_round, grad_hook and
    after_step (during compute), finish; on preemption: drain; always: close."""

    staleness = 0  # rounds by which this mode's update lands late

    def __init__(self, run: RoundContext):
        self.run = run

    def join(self) -> None:
        """Enter the run before the first round (quorum, heal, or the outer service)."""

    def begin_round(self) -> None:
        """Called before the round's inner steps."""

    def after_step(self, done: int, h: int) -> float:
        """Called after each inner step (`done` of the round's `h`); returns the seconds this step
        spent in the exchange, which the round's compute time leaves out."""
        return 0.0

    def grad_hook(self, site_hook: GradHook | None) -> GradHook | None:
        """The hook each inner step runs on its gradients (default: only the in-site average)."""
        return site_hook

    def finish(self, last: bool) -> ExchangeResult:
        """The exchange at the end of the round's inner steps; `last`: the run's final round."""
        raise NotImplementedError

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait for an exchange still in flight (preemption: before the checkpoint is saved)."""

    def close(self) -> None:
        """Release threads and connections; safe to call twice."""
