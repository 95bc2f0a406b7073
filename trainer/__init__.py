"""The bundled DiLoCo trainer: what `dilococtl launch` starts under torchrun at every site.

Where things are (simulate.py's `sync_round` is DiLoCo in ten lines; the rest is how a site does it
for real, checked against it):

- entry.py: `torchrun -m trainer --config FILE`; records.py: the round records the control plane reads
- site.py, model.py, data.py: one site's inner steps; parallel/: TP, PP and FSDP inside a site
- modes/: a round in each mode: loop.py (the round pipeline), ft_exchange.py (sync, overlap, ddp over
  torchft's quorum), async_mode.py; ft.py and torchft_compat.py wire torchft
- codecs/: the Compressor with error feedback, quantizers, the sparse codec, the sharded averages
  (quant_shards, sparse_codec: SparseShards) and their owner's error feedback (owner_feedback)
- outer/: the outer Nesterov step, the guard and robust aggregation, the checks on a healed state
- transport/: the mutual-TLS cross-site transport; collectives.py: the interface it implements
- service/: the Lighthouse and the async outer service; checkpoints/: DCP checkpoints, object stores
- probes/: what a node measures for tune-h and doctor; rules/: the torch-free config and rules that
  dilococtl reads too

Importing this package must not import torch: the control plane reads `trainer.records` and
`trainer.rules.config` without it.
"""

__version__ = "0.1.0"
