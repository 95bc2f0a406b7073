"""One site's local training: model, inner AdamW, data loader, and one inner step.

Used by the distributed trainer (one per process) and by the simulator (K in one process).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from trainer.config import TrainerConfig
from trainer.data import BatchLoader, partition
from trainer.model import build_model, loss_fn
from trainer.schedule import lr_at

GradHook = Callable[[list[torch.Tensor]], None]


def pick_device(cfg: TrainerConfig) -> torch.device:
    want = cfg.train.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(want)


class SiteTrainer:
    """The state a site trains with between two outer steps.

    `shard`/`shards` split the site's data partition between the processes of one site.
    """

    def __init__(self, cfg: TrainerConfig, train_tokens, site_index: int, device: torch.device,
                 shard: int = 0, shards: int = 1):
        self.cfg = cfg
        self.device = device
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
        self.autocast = device.type == "cuda" and t.bf16

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for p in self.model.parameters()]

    def forward_backward(self) -> tuple[float, float]:
        """Gradients of the next batch at the scheduled lr; returns (loss, lr)."""
        lr = lr_at(self.step, self.cfg.total_steps, self.cfg.train)
        for group in self.inner.param_groups:
            group["lr"] = lr
        x, y = self.loader.next_batch()
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            loss = loss_fn(self.model(x), y)
        loss.backward()
        self.tokens += x.numel()
        return float(loss.detach()), lr

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.model.parameters()]

    def update(self) -> None:
        """Clip and apply the inner AdamW step."""
        if self.cfg.train.grad_clip > 0:
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
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                total += float(loss_fn(self.model(x), y))
        self.model.train()
        return total / max(1, len(batches))
