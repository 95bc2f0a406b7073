"""Parallelism inside one site: tensor parallel, pipeline parallel and FSDP2, composed in one place.

One module per concern (mesh.py, tensor_parallel.py, pipeline.py, fsdp.py, state.py);
`parallelize` applies them in the order that works: cut the pipeline stage, shard it with TP,
compile blocks (GPU), then FSDP on top.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.parallel.device_mesh import ParallelDims, build_mesh, submesh
from trainer.rules.config import ParallelConfig


@dataclass(kw_only=True, slots=True)
class Parallel:
    """What a process needs to train its part of the model."""

    dims: ParallelDims  # the site's split
    rank: int  # this process's rank in the site
    mesh: Any  # the DeviceMesh (None for one process)
    stage: int  # this process's pipeline stage
    pp_group: Any  # process group of the pipeline (None without pp)
    dp_replicate_group: Any  # process group that averages plain data-parallel gradients (None: no such dim)

    @property
    def dp_rank(self) -> int:
        return self.dims.dp_rank(self.rank)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.dims.pp - 1


def setup(par: ParallelConfig, device: torch.device) -> Parallel:
    """The mesh and groups for this process (the default process group must exist when world > 1)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    dims = ParallelDims.from_config(par, world)
    mesh = build_mesh(dims, device.type)
    pp_mesh = submesh(mesh, "pp")
    rep_mesh = submesh(mesh, "dp_replicate")
    return Parallel(dims=dims, rank=rank, mesh=mesh, stage=dims.coords(rank)["pp"],
                    pp_group=pp_mesh.get_group() if pp_mesh is not None else None,
                    dp_replicate_group=rep_mesh.get_group() if rep_mesh is not None else None)


def parallelize(model: nn.Module, cfg: ParallelConfig, p: Parallel, bf16: bool = False) -> nn.Module:
    """Apply pipeline split, tensor parallel, compile and FSDP2 to `model` in place, as `cfg` asks.

    `model` is the full, initialised model (identical on every rank); what a rank does not own is
    dropped and the rest is sharded. `bf16`: FSDP gathers parameters in bf16 (fp32 masters stay).
    """
    d = p.dims
    if d.pp > 1:
        from trainer.parallel.pipeline import split_stage

        split_stage(model, p.stage, d.pp)
    if d.tp > 1:
        from trainer.parallel.tensor_parallel import apply_tp

        # a later stage gets hidden states, not tokens: the sequence length must be whole there
        apply_tp(model, submesh(p.mesh, "tp"), sequence_parallel=cfg.sequence_parallel and d.pp == 1)
    if cfg.compile and next(model.parameters()).device.type == "cuda":
        for block in model.layers.values():
            block.compile()  # in place: parameter names (and so checkpoints) do not change
    if d.dp_shard > 1:
        from trainer.parallel.fsdp import apply_fsdp

        apply_fsdp(model, submesh(p.mesh, "dp_replicate", "dp_shard"), bf16=bf16,
                   reshard_after_forward=d.pp == 1)
    return model


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise), sharing its storage."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def clip_grad_norm_(params: list[torch.Tensor], max_norm: float, pp_group=None) -> float:
    """Clip gradients to a global L2 norm over every shard and every pipeline stage; the norm.

    DTensor gradients (TP, FSDP) give their full norm through DTensor's own reduction; plain
    gradients are whole (replicated) on every rank; pipeline stages hold disjoint parameters,
    so their squared norms are summed over the pipeline group.
    """
    from torch.distributed.tensor import DTensor

    grads = [q.grad for q in params if q.grad is not None]
    sq = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
    for g in grads:
        n = torch.linalg.vector_norm(g, dtype=torch.float32)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        sq += n.to(sq.device) ** 2
    if pp_group is not None:
        dist.all_reduce(sq, group=pp_group)
    norm = sq.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        local(g).mul_(coef.to(local(g).device))
    return float(norm)


__all__ = ["Parallel", "ParallelDims", "clip_grad_norm_", "local", "parallelize", "setup"]
