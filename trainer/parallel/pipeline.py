"""Pipeline parallel with torch.distributed.pipelining: contiguous layers per stage, GPipe or 1F1B.

A stage keeps the original module names (layers "4".."7" stay "4".."7"), so its state dict keys are
the full model's and DCP checkpoints reshard between pipeline layouts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def stage_layers(n_layers: int, n_stages: int, stage: int) -> list[int]:
    """Layer indices of `stage`: contiguous, the first stages take one more when it does not divide."""
    base, extra = divmod(n_layers, n_stages)
    start = stage * base + min(stage, extra)
    return list(range(start, start + base + (1 if stage < extra else 0)))


def split_stage(model: nn.Module, stage: int, n_stages: int) -> nn.Module:
    """Cut `model` down to `stage` in place: its layers; the embedding on the first, norm + head on the last."""
    keep = {str(i) for i in stage_layers(len(model.layers), n_stages, stage)}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if stage > 0:
        model.tok_embeddings = None
    if stage < n_stages - 1:
        model.norm = None
        model.output = None
    return model


def build_schedule(stage_module: nn.Module, stage: int, n_stages: int, device: torch.device, group,
                   microbatches: int, schedule: str, loss_fn: Callable):
    """The pipeline schedule that runs `stage_module` as `stage` of `n_stages` over `group`.

    Each microbatch's loss is a mean and the schedule scales gradients by 1 / microbatches, so
    with equal microbatches the gradients equal those of the whole batch's mean loss.
    """
    pstage = PipelineStage(stage_module, stage, n_stages, device, group=group)
    return SCHEDULES[schedule](pstage, n_microbatches=microbatches, loss_fn=loss_fn)
