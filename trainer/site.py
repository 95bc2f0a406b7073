"""One site's local training: model, inner AdamW, data loader, and one inner step.

Used by the distributed trainer (one per process) and by the simulator (K in one process).
With tp, pp or dp_shard > 1 in `cfg.parallel` (trainer.parallel), each process holds its part of
the model and reads the batches of its data-parallel index only.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from trainer.data import BatchLoader, partition
from trainer.model import build_model, loss_fn
from trainer.rules.config import TrainerConfig
from trainer.rules.schedule import lr_at

GradHook = Callable[[list[torch.Tensor]], None]


def flat_average(tensors: list[torch.Tensor], reduce_sum: Callable[[torch.Tensor], object],
                 n: int | None = None, *, keep: Callable[[], bool] | None = None) -> None:
    """Average `tensors` in place over the processes that call this with the same shapes: one flat
    buffer, summed in place by `reduce_sum`, divided, then copied back into the tensors.

    n: the number of processes in the sum; the buffer keeps the tensors' dtype and device.
    n None (the cross-site sum, whose membership is known only after it): the buffer is fp32 on the
    CPU with one more slot, 1 from each contributor, and the sum is divided by that count (at
    least 1); `reduce_sum` may read the count at flat[-1].
    keep: asked after the sum; False zeroes the tensors instead of averaging them.
    """
    if n is None:
        flat = torch.cat([t.reshape(-1).float().cpu() for t in tensors] + [torch.ones(1)])
    else:
        flat = torch.cat([t.reshape(-1) for t in tensors])
    reduce_sum(flat)
    ok = keep is None or keep()
    flat /= n if n is not None else max(1.0, float(flat[-1]))
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t) if ok else torch.zeros_like(t))
        offset += t.numel()


def pick_device(cfg: TrainerConfig) -> torch.device:
    want = cfg.train.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(want)


class SiteTrainer:
    """The state a site trains with between two outer steps.

    `shard`/`shards` split the site's data partition between the processes of one site; with
    model parallelism on (`self.par`), they are replaced by the data-parallel index and degree.
    """

    def __init__(self, cfg: TrainerConfig, train_tokens, site_index: int, device: torch.device,
                 shard: int = 0, shards: int = 1):
        self.cfg = cfg
        self.device = device
        self.par = None  # trainer.parallel.Parallel when tp, pp or dp_shard > 1
        self.schedule = None  # the pipeline schedule when pp > 1
        pc = cfg.parallel
        if pc.tp > 1 or pc.pp > 1 or pc.dp_shard > 1:
            from trainer import parallel

            self.par = parallel.setup(pc, device)
            shard, shards = self.par.dp_rank, self.par.dims.dp
            # the full model is built everywhere (same seed: same values), then cut and sharded
            self.model = build_model(cfg.model, cfg.train.seed, device=device)
            parallel.parallelize(self.model, pc, self.par, bf16=device.type == "cuda" and cfg.train.bf16)
            if self.par.dims.pp > 1:
                from trainer.parallel.pipeline import build_schedule

                self.schedule = build_schedule(self.model, self.par.stage, self.par.dims.pp, device,
                                               self.par.pp_group, pc.microbatches or pc.pp, pc.pp_schedule,
                                               loss_fn)
        else:
            self.model = build_model(cfg.model, cfg.train.seed, device=device)
        t = cfg.train
        self.inner = torch.optim.AdamW(self.model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2),
                                       weight_decay=t.weight_decay)
        part = partition(train_tokens, cfg.diloco.sites, site_index)
        if shards > 1:
            part = partition(part, shards, shard)
        self.loader = BatchLoader(part, cfg.data.seq_len, cfg.data.batch_size, cfg.data.seed, site_index)
        self.step = 0  # inner steps done (monotonic across restarts)
        self.tokens = 0  # tokens trained on by this process
        self.lr_step: int | None = None  # the schedule's position when it is not self.step (h_policy "time")
        # FSDP casts parameters itself (fp32 masters, bf16 compute); elsewhere autocast does
        self.autocast = device.type == "cuda" and t.bf16 and cfg.parallel.dp_shard == 1
        self.dp = shards  # data-parallel degree of the site: tokens per step = dp * batch * seq

    @property
    def params(self) -> list[torch.Tensor]:
        """The model's parameters (DTensors under TP/FSDP; only this stage's under pp)."""
        return [p for p in self.model.parameters()]

    @property
    def local_params(self) -> list[torch.Tensor]:
        """This process's shards of `params`, sharing their storage (the tensors themselves without DTensors)."""
        from trainer.parallel import local

        return [local(p) for p in self.model.parameters()]

    def grad_hook(self) -> GradHook | None:
        """With model parallelism: the hook that averages gradients over the plain data-parallel
        replicas (FSDP reduces its own shard dimension; TP and pp need nothing). None without it."""
        group = self.par.dp_replicate_group if self.par is not None else None
        if group is None:
            return None
        from trainer.parallel import local

        n = dist.get_world_size(group)

        def hook(grads: list[torch.Tensor]) -> None:
            flat_average([local(g) for g in grads], lambda flat: dist.all_reduce(flat, group=group), n)
        return hook

    def forward_backward(self) -> tuple[float, float]:
        """Gradients of the next batch at the scheduled lr; returns (loss, lr)."""
        lr = lr_at(self.step if self.lr_step is None else self.lr_step, self.cfg.total_steps, self.cfg.train)
        for group in self.inner.param_groups:
            group["lr"] = lr
        x, y = self.loader.next_batch()
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        self.tokens += x.numel()
        if self.schedule is not None:
            return self._pipeline_step(x, y, train=True), lr
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            loss = loss_fn(self.model(x), y)
        loss.backward()
        return float(loss.detach()), lr

    def _pipeline_step(self, x: torch.Tensor, y: torch.Tensor, train: bool) -> float:
        """One pipelined forward (+ backward) of the batch; the mean loss, on every stage."""
        p = self.par
        losses: list[torch.Tensor] | None = [] if p.is_last else None
        args = (x,) if p.is_first else ()
        target = y if p.is_last else None
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            if train:
                self.schedule.step(*args, target=target, losses=losses)
            else:
                self.schedule.eval(*args, target=target, losses=losses)
        loss = torch.stack([v.detach().float() for v in losses]).mean() if losses \
            else torch.zeros((), device=self.device)
        # only the last stage computes the loss: it tells the others
        dist.broadcast(loss, group=p.pp_group, group_src=p.dims.pp - 1)
        return float(loss)

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.model.parameters()]

    def update(self) -> None:
        """Clip and apply the inner AdamW step."""
        if self.cfg.train.grad_clip > 0:
            if self.par is not None:
                from trainer.parallel import clip_grad_norm_

                clip_grad_norm_(self.params, self.cfg.train.grad_clip, self.par.pp_group)
            else:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip)
        self.inner.step()
        self.inner.zero_grad(set_to_none=True)
        self.step += 1

    def inner_step(self, grad_hook: GradHook | None = None) -> tuple[float, float, float]:
        """One AdamW step on the next batch; returns (loss, lr, seconds).

        `grad_hook` averages gradients before the update (inside a site across its processes, or
        across sites for the data-parallel baseline).
        """
        t0 = time.perf_counter()
        loss, lr = self.forward_backward()
        if grad_hook is not None:
            grad_hook(self.grads())
        self.update()
        return loss, lr, time.perf_counter() - t0

    @torch.no_grad()
    def evaluate(self, batches) -> float:
        """Mean validation loss over fixed batches."""
        self.model.eval()
        total = 0.0
        for x, y in batches:
            x, y = x.to(self.device), y.to(self.device)
            if self.schedule is not None:
                total += self._pipeline_step(x, y, train=False)
                continue
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                total += float(loss_fn(self.model(x), y))
        self.model.train()
        return total / max(1, len(batches))
