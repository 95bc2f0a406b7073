"""Checkpointable state of a parallelized site, keyed by parameter name, so DCP can reshard it.

Everything here maps a parameter's fully qualified name to a tensor laid out like the parameter
(a DTensor under TP/FSDP, a plain tensor otherwise): DCP then loads a checkpoint written with one
tp/pp/dp_shard layout into any other, or into a single process. The optimizer's own state_dict
(keyed by integer position) cannot do that: a pipeline stage or a one-process model numbers the
parameters differently.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from trainer.outer.optimizer import OuterState


def model_state(model: nn.Module) -> dict:
    """Parameters by name (sharded where the model is)."""
    return get_model_state_dict(model)


def load_model_state(model: nn.Module, sd: dict) -> None:
    set_model_state_dict(model, sd)


@torch.no_grad()
def init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Give every parameter an empty AdamW state (step 0, zero moments), as the first step would.

    DCP loads in place: a fresh optimizer needs tensors of the right layout to load into. The
    values equal what AdamW's first step creates, so training on from here is unchanged.
    """
    for group in opt.param_groups:
        for p in group["params"]:
            if not opt.state[p]:
                opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                "exp_avg_sq": torch.zeros_like(p)}


def optimizer_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The inner optimizer's state by parameter name (call init_optimizer_state first on a fresh one)."""
    return get_optimizer_state_dict(model, opt)


def load_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer, sd: dict) -> None:
    set_optimizer_state_dict(model, opt, sd)


def _like(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`t` (this rank's shard of p) seen as a tensor laid out like parameter `p`; shares t's storage."""
    if isinstance(p, DTensor):
        return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return t


def outer_state(outer: OuterState, model: nn.Module) -> dict:
    """θ_t and the outer momentum by parameter name, sharded like the model (fp32).

    A parameter without a momentum buffer yet (no outer step so far) gets zeros: SGD's first
    step sets the buffer to the gradient, which is what a zero buffer plus the gradient gives.
    """
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    theta, mom = {}, {}
    for name, p, g in zip(names, params, outer.params, strict=True):
        st = outer.opt.state[g]
        if st.get("momentum_buffer") is None and outer.opt.defaults["momentum"] > 0:
            st["momentum_buffer"] = torch.zeros_like(g)
        theta[name] = _like(g.data, p)
        if "momentum_buffer" in st:
            mom[name] = _like(st["momentum_buffer"], p)
    return {"params": theta, "momentum": mom}


@torch.no_grad()
def load_outer_state(outer: OuterState, model: nn.Module, sd: dict) -> None:
    """Copy a loaded `outer_state` dict back into `outer` (DCP may have loaded into copies)."""
    names = [n for n, _ in model.named_parameters()]
    for name, g in zip(names, outer.params, strict=True):
        src = sd["params"][name]
        g.copy_(src.to_local() if isinstance(src, DTensor) else src)
        if name in sd["momentum"]:
            m = sd["momentum"][name]
            m = m.to_local() if isinstance(m, DTensor) else m
            buf = outer.opt.state[g].get("momentum_buffer")
            if buf is None:
                outer.opt.state[g]["momentum_buffer"] = m.detach().clone()
            else:
                buf.copy_(m)
