"""The outer optimizer: global parameters θ_t and Nesterov SGD on the averaged pseudo-gradient.

Shared by the distributed trainer and the simulator, so both compute the same thing.
Local SGD is the same with lr 1 and no momentum (θ_{t+1} = mean of the sites' parameters).
Under tensor parallel or FSDP the site's parameters are DTensors: θ_t, Δ and the momentum are
kept for this rank's shard only (`.to_local()`), so no rank ever holds the whole model.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainer.config import DilocoConfig
from trainer.parallel import local as local_


DAMPENINGS = ("inverse", "sqrt")


def default_outer_hparams(h: int, mode: str) -> tuple[float, float]:
    """(lr, momentum) of the outer Nesterov SGD when the spec leaves them unset: one measured rule.

    RULE_PLACEHOLDER
    """
    return 0.7, 0.9


def outer_hparams(cfg: DilocoConfig) -> tuple[float, float]:
    """(lr, momentum) of the outer SGD: localsgd's fixed pair, the spec's values, else the rule."""
    if cfg.algorithm == "localsgd":
        return 1.0, 0.0
    lr, momentum = default_outer_hparams(cfg.h, cfg.mode)
    return (lr if cfg.outer_lr is None else cfg.outer_lr,
            momentum if cfg.outer_momentum is None else cfg.outer_momentum)


def dampening(gamma: int, alpha: float, kind: str = "inverse") -> float:
    """ψ(γ): 1/(1+αγ) ("inverse") or 1/sqrt(1+γ) ("sqrt"); γ >= 0 is the push's staleness."""
    if gamma < 0:
        raise ValueError(f"staleness must be >= 0, got {gamma}")
    if kind == "inverse":
        return 1.0 / (1.0 + alpha * gamma)
    if kind == "sqrt":
        return 1.0 / math.sqrt(1.0 + gamma)
    raise ValueError(f"dampening must be one of {', '.join(DAMPENINGS)}, got {kind!r}")


def effective_lr(cfg: DilocoConfig, k_active: int) -> float:
    """η_eff = η · K_active / K_nominal when elastic scaling is on."""
    lr, _ = outer_hparams(cfg)
    if cfg.elastic_lr and cfg.algorithm != "localsgd":
        return lr * k_active / cfg.sites
    return lr


class OuterState:
    """θ_t as fp32 CPU tensors (this rank's shards of DTensors), owned by torch.optim.SGD(nesterov=True)."""

    def __init__(self, params: list[torch.Tensor], cfg: DilocoConfig):
        self.cfg = cfg
        self.params = [torch.nn.Parameter(local_(p).detach().float().cpu().clone()) for p in params]
        lr, momentum = outer_hparams(cfg)
        self.opt = torch.optim.SGD(self.params, lr=lr, momentum=momentum, nesterov=momentum > 0)

    @torch.no_grad()
    def deltas(self, local: list[torch.Tensor]) -> list[torch.Tensor]:
        """Pseudo-gradient Δ = θ_t − θ_local, per parameter (fp32, CPU)."""
        return [g.detach() - local_(p).detach().float().cpu() for g, p in zip(self.params, local, strict=True)]

    @torch.no_grad()
    def step(self, avg_deltas: list[torch.Tensor], k_active: int) -> float:
        """Apply the outer step with Δ̄ as the gradient; returns the lr used."""
        lr = effective_lr(self.cfg, k_active)
        for group in self.opt.param_groups:
            group["lr"] = lr
        for p, d in zip(self.params, avg_deltas, strict=True):
            p.grad = d.to(p.dtype).reshape(p.shape).clone()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return lr

    @torch.no_grad()
    def copy_to(self, local: list[torch.Tensor]) -> None:
        """Reset the site's parameters to θ_t."""
        for g, p in zip(self.params, local, strict=True):
            p = local_(p)
            p.copy_(g.to(p.device, p.dtype))

    def state_dict(self) -> dict:
        return {"params": [p.detach() for p in self.params], "opt": self.opt.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        for p, q in zip(self.params, sd["params"], strict=True):
            p.copy_(q)
        # torch aliases same-device tensors on load: copy, so two states never share a buffer
        self.opt.load_state_dict(copy.deepcopy(sd["opt"]))


@dataclass(kw_only=True, slots=True)
class PushStep:
    scale: float  # ψ(γ), the dampening the push's Δ was multiplied by
    lr: float  # outer lr of the step (η · 1/K with elastic_lr)


@torch.no_grad()
def apply_push(outer: OuterState, delta: Sequence[torch.Tensor], gamma: int) -> PushStep:
    """Async mode: apply one site's Δ, computed on a θ `gamma` versions old, as its share of a round.

    The outer service (trainer.outer_service) and the simulator both call this, so they agree:
    the gradient is ψ(γ)·Δ, the lr that of one active site (η/K with elastic_lr), and Nesterov
    momentum is stepped on every push.
    """
    cfg = outer.cfg
    scale = dampening(gamma, cfg.async_alpha, cfg.async_dampening)
    lr = outer.step([d * scale for d in delta], 1)
    return PushStep(scale=scale, lr=lr)


@torch.no_grad()
def overlap_rebase(local: Sequence[torch.Tensor], theta: Sequence[torch.Tensor],
                   own: Sequence[torch.Tensor]) -> None:
    """Overlap mode, when round t's update lands at the end of round t+1: local = θ_{t+1} − own.

    `own` is the site's progress over round t+1 (its start minus its parameters now), which is also
    the pseudo-gradient it sends next; the rebase keeps it on top of the new global parameters.
    """
    for p, g, o in zip(local, theta, own, strict=True):
        p = local_(p)
        p.copy_((g.detach() - o).to(p.device, p.dtype))
