"""dilococtl: launch and operate DiLoCo training across datacenters."""

from trainer import __version__

__all__ = ["__version__"]
