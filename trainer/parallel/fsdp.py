"""FSDP2 (`fully_shard`) per transformer block, then the root for the embeddings and head.

Sharding per block lets FSDP all-gather one block's parameters while the previous one computes.
The sharded parameters stay fp32 (the master copy AdamW updates); on GPU they are all-gathered in
bf16 for compute and gradients are reduce-scattered in fp32.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, bf16: bool = False,
               reshard_after_forward: bool = True) -> nn.Module:
    """Shard `model` over `dp_mesh` (1-D: FSDP, 2-D replicate x shard: HSDP) in place; returns it.

    `reshard_after_forward=False` keeps a block gathered until its backward: what pipeline
    stages want, since their microbatches would gather it again and again.
    """
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                              reduce_dtype=torch.float32 if bf16 else None)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return model
