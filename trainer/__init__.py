"""The bundled DiLoCo trainer: what `dilococtl launch` starts under torchrun at every site.

Importing this package must not import torch: the control plane reads `trainer.records` and
`trainer.config` without it.
"""

__version__ = "0.1.0"
