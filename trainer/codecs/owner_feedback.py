"""Error feedback at a shard's owner, shared by the sharded averages (QuantShards, SparseShards).

In a sharded average each site owns one shard: it averages every member's message for it and encodes
that average again for the all-gather. What the second encoding loses is kept and added to the
owner's next average of the same shard; a site that comes to own another shard (the quorum
changed) or a shard of another size starts from zero.
"""

from __future__ import annotations

import torch
from torch import Tensor


class OwnerFeedback:
    """The residual of the shard this site owns (the checkpoint saves `owner` and `residual`)."""

    owner: int = -1  # the shard the residual belongs to
    residual: Tensor | None = None

    def add_residual(self, mean: Tensor, j: int) -> Tensor:
        """`mean` (shard j's fresh average) plus what the last encoding of shard j lost, in place."""
        if self.residual is None or self.owner != j or len(self.residual) != len(mean):
            self.owner, self.residual = j, torch.zeros(len(mean))
        return mean.add_(self.residual)

    def keep_residual(self, lost: Tensor) -> None:
        """What this round's encoding of the owned shard lost (the average minus what was sent)."""
        self.residual = lost
