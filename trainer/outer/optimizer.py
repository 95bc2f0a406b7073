"""The outer optimizer: global parameters θ_t and Nesterov SGD on the averaged pseudo-gradient.

Shared by the distributed trainer and the simulator, so both compute the same thing.
Local SGD is the same with lr 1 and no momentum (θ_{t+1} = mean of the sites' parameters).
Under tensor parallel or FSDP the site's parameters are DTensors: θ_t, Δ and the momentum are
kept for this rank's shard only (`.to_local()`), so no rank ever holds the whole model.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from trainer.parallel import local as local_
from trainer.rules.diloco_config import DilocoConfig
from trainer.rules.outer_rule import async_alpha, default_outer_hparams, land_step, outer_hparams  # noqa: F401 (re-exported)

DAMPENINGS = ("inverse", "sqrt")


def dampening(gamma: int, alpha: float, kind: str = "inverse") -> float:
    """ψ(γ): 1/(1+αγ) ("inverse") or 1/sqrt(1+γ) ("sqrt"); γ >= 0 is the push's staleness."""
    if gamma < 0:
        raise ValueError(f"staleness must be >= 0, got {gamma}")
    if kind == "inverse":
        return 1.0 / (1.0 + alpha * gamma)
    if kind == "sqrt":
        return 1.0 / math.sqrt(1.0 + gamma)
    raise ValueError(f"dampening must be one of {', '.join(DAMPENINGS)}, got {kind!r}")


def effective_lr(cfg: DilocoConfig, k_active: int, lr: float | None = None) -> float:
    """η_eff = η · K_active / K_nominal when elastic scaling is on; η is `lr`, else outer_hparams(cfg)'s."""
    if lr is None:
        lr, _ = outer_hparams(cfg)
    if cfg.elastic_lr and cfg.algorithm != "localsgd":
        return lr * k_active / cfg.sites
    return lr


class OuterState:
    """θ_t as fp32 CPU tensors (this rank's shards of DTensors), owned by torch.optim.SGD(nesterov=True)."""

    def __init__(self, params: list[torch.Tensor], cfg: DilocoConfig, rounds: int | None = None):
        """`rounds`: the run's planned outer rounds, for the default rule (outer_hparams; None:
        diloco.rounds)."""
        self.cfg = cfg
        self.params = [torch.nn.Parameter(local_(p).detach().float().cpu().clone()) for p in params]
        lr, momentum = outer_hparams(cfg, rounds)
        self.lr, self.momentum = lr, momentum
        self.alpha = async_alpha(cfg, rounds)  # async: the staleness dampening's α
        self.opt = torch.optim.SGD(self.params, lr=lr, momentum=momentum, nesterov=momentum > 0)
        # async_momentum = "delayed": the pushes of the current round summed, how many, the round momentum
        self.delayed: dict = {"sum": None, "n": 0, "m": None}

    def _only(self, only: Sequence[int] | None) -> list[int]:
        return list(range(len(self.params))) if only is None else list(only)

    @torch.no_grad()
    def deltas(self, local: list[torch.Tensor], only: Sequence[int] | None = None) -> list[torch.Tensor]:
        """Pseudo-gradient Δ = θ_t − θ_local, per parameter (fp32, CPU); `only`: of these parameter
        indices (a fragment, trainer.rules.fragments), in that order."""
        if len(local) != len(self.params):
            raise ValueError(f"{len(local)} local parameters for {len(self.params)} global ones")
        return [self.params[i].detach() - local_(local[i]).detach().float().cpu() for i in self._only(only)]

    @torch.no_grad()
    def step(self, avg_deltas: list[torch.Tensor], k_active: int, only: Sequence[int] | None = None) -> float:
        """Apply the outer step with Δ̄ as the gradient; returns the lr used. `only`: Δ̄ is of these
        parameter indices (a fragment); the others, and their momentum, do not move."""
        lr = effective_lr(self.cfg, k_active, self.lr)
        for group in self.opt.param_groups:
            group["lr"] = lr
        for i, d in zip(self._only(only), avg_deltas, strict=True):
            p = self.params[i]
            p.grad = d.to(p.dtype).reshape(p.shape).clone()  # SGD skips a parameter without a gradient
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return lr

    @torch.no_grad()
    def delayed_push(self, grad: list[torch.Tensor]) -> float:
        """Async with delayed Nesterov (Asynchronous Local-SGD, arXiv 2401.09135): one push's step.

        Each push moves θ by η/K·g at once (the gradient part of a round's Nesterov step, shared
        out over its K pushes); the momentum moves only once per K pushes: m = μm + Σg/K,
        θ -= η·μ·m. K pushes on one θ then make exactly one synchronous Nesterov round.
        Returns the lr of the push's own step.
        """
        lr = effective_lr(self.cfg, 1, self.lr)
        st = self.delayed
        if st["sum"] is None:
            st["sum"] = [torch.zeros_like(p) for p in self.params]
            st["m"] = [torch.zeros_like(p) for p in self.params]
        for p, g, acc in zip(self.params, grad, st["sum"], strict=True):
            g = g.to(p.dtype).reshape(p.shape)
            p.sub_(g, alpha=lr)
            acc.add_(g)
        st["n"] += 1
        k = self.cfg.sites
        if st["n"] >= k:
            lr_round = effective_lr(self.cfg, k, self.lr)
            for p, acc, m in zip(self.params, st["sum"], st["m"], strict=True):
                m.mul_(self.momentum).add_(acc, alpha=1.0 / k)
                p.sub_(m, alpha=lr_round * self.momentum)
                acc.zero_()
            st["n"] = 0
        return lr

    @torch.no_grad()
    def copy_to(self, local: list[torch.Tensor], only: Sequence[int] | None = None) -> None:
        """Reset the site's parameters (`only`: those of these indices) to θ_t."""
        if len(local) != len(self.params):
            raise ValueError(f"{len(local)} local parameters for {len(self.params)} global ones")
        for i in self._only(only):
            p = local_(local[i])
            p.copy_(self.params[i].to(p.device, p.dtype))

    @contextmanager
    def installed(self, local: list[torch.Tensor]) -> Iterator[None]:
        """The site's parameters set to θ_t inside the block, its own put back after (diloco.fragments:
        an evaluation of θ while the site's own parameters mix θ and local progress)."""
        with torch.no_grad():
            own = [local_(p).detach().clone() for p in local]
            self.copy_to(local)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, o in zip(local, own, strict=True):
                    local_(p).copy_(o)

    def state_dict(self) -> dict:
        sd = {"params": [p.detach() for p in self.params], "opt": self.opt.state_dict()}
        if self.delayed["sum"] is not None:
            sd["delayed"] = {"sum": [t.clone() for t in self.delayed["sum"]], "n": self.delayed["n"],
                             "m": [t.clone() for t in self.delayed["m"]]}
        return sd

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        """θ and the state tensors (momentum buffers) of `sd`; lr, momentum, nesterov and every other
        hyperparameter stay this site's own (its config), whoever wrote `sd` (a heal source, a checkpoint)."""
        for p, q in zip(self.params, sd["params"], strict=True):
            p.copy_(q)
        mine = self.opt.state_dict()  # this site's param_groups; only the state comes from `sd`
        # torch aliases same-device tensors on load: copy, so two states never share a buffer
        mine["state"] = {int(i): {"momentum_buffer": copy.deepcopy(s["momentum_buffer"])}
                         for i, s in sd["opt"].get("state", {}).items()
                         if isinstance(s, dict) and isinstance(s.get("momentum_buffer"), torch.Tensor)}
        self.opt.load_state_dict(mine)
        if "delayed" in sd:
            dl = sd["delayed"]
            self.delayed = {"sum": [t.clone() for t in dl["sum"]], "n": int(dl["n"]), "m": [t.clone() for t in dl["m"]]}


@dataclass(kw_only=True, slots=True)
class PushStep:
    scale: float  # ψ(γ), the dampening the push's Δ was multiplied by
    lr: float  # outer lr of the step (η · 1/K with elastic_lr)


@torch.no_grad()
def apply_push(outer: OuterState, delta: Sequence[torch.Tensor], gamma: int, weight: float = 1.0) -> PushStep:
    """Async mode: apply one site's Δ, computed on a θ `gamma` versions old, as its share of a round.

    The outer service (trainer.service.outer_service) and the simulator both call this, so they agree:
    the gradient is ψ(γ)·Δ, the lr that of one active site (η/K with elastic_lr). Nesterov momentum
    is stepped on every push (async_momentum = "push"), or once per K pushes ("delayed",
    OuterState.delayed_push). `weight` multiplies the push besides ψ (the service's norm clip).
    """
    cfg = outer.cfg
    scale = dampening(gamma, outer.alpha, cfg.async_dampening)
    grad = [d * (scale * weight) for d in delta]
    if cfg.async_momentum == "delayed" and cfg.algorithm != "localsgd":
        lr = outer.delayed_push(grad)
    else:
        lr = outer.step(grad, 1)
    return PushStep(scale=scale, lr=lr)


@torch.no_grad()
def overlap_rebase(local: Sequence[torch.Tensor], theta: Sequence[torch.Tensor],
                   own: Sequence[torch.Tensor], mix: float = 0.0) -> None:
    """Overlap mode, when round t's update lands at the end of round t+1: local = θ_{t+1} − own.

    `own` is the site's progress over round t+1 (its start minus its parameters now), which is also
    the pseudo-gradient it sends next; the rebase keeps it on top of the new global parameters.
    With `mix` > 0 (Streaming DiLoCo's mixing factor, diloco.overlap_mix) the site keeps that
    fraction of its own parameters: local = (1 − mix)(θ_{t+1} − own) + mix · local.
    """
    for p, g, o in zip(local, theta, own, strict=True):
        p = local_(p)
        new = (g.detach() - o).to(p.device, p.dtype)
        p.copy_(torch.lerp(new, p, mix) if mix else new)
