"""Tensor parallel (DTensor) for trainer.model.Transformer, as torchtitan plans LLaMA.

q/k/v and the MLP's input projections are split by output column, the attention and MLP output
projections by input row, so each block needs one all-reduce forward and one backward. With
sequence parallel the norms (and the residual stream between blocks) run on sequence shards: the
all-reduce becomes a reduce-scatter + all-gather pair and activations there are 1/tp the size.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = True) -> nn.Module:
    """Shard `model`'s linear layers over `tp_mesh` in place; returns it.

    Works on a pipeline stage too: modules set to None (not owned by the stage) are skipped.
    Sequence parallel is only valid for a model that sees token ids (the full sequence length
    comes from them), so a stage without the embedding must be given sequence_parallel=False.
    """
    sp = sequence_parallel
    stream = Shard(1) if sp else Replicate()  # layout of the residual stream between blocks
    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    if model.norm is not None and sp:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=stream, output_layouts=Replicate(), use_local_output=True)
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        plan: dict[str, object] = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=stream),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=stream),
            "feed_forward.w3": ColwiseParallel(),
        }
        if sp:
            plan.update({
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(block, tp_mesh, plan)
    return model
