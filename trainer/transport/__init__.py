"""The trainer's cross-site transport: the `Comm` collectives over mutual TLS 1.3 with many streams.

    listener = Listener(identity)                 # once per process: its port is advertised
    comm = connect(listener, rank=r, sites=[...], addrs=[...], streams=8, session=sid, timeout_s=60)
    comm.allreduce_sum(t); comm.allgather(t); comm.alltoall(t)
    comm.close()                                  # before the next quorum builds another

`trainer.transport.pg` wraps it as a torchft ProcessGroup (the quorum tells it ranks and the
store through which members find each other); `trainer.transport.heal` moves heal state over it;
`trainer.transport.check` runs one real handshake between two nodes before a run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.transport.comm import TlsComm
    from trainer.transport.mesh import Listener

# Loaded on first use (PEP 562): the relay and the TLS checks import this package too, and need
# none of torch, which trainer.transport.comm imports (~2 CPU-s and ~200 MB per relay process).
_EXPORTS = {"TlsComm": "comm", "Listener": "mesh", "Mesh": "mesh", "build_mesh": "mesh", "Identity": "tls",
            "PeerRefused": "tls", "TransportError": "tls", "CollectiveMismatch": "wire", "PeerLost": "wire"}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'trainer.transport' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"trainer.transport.{_EXPORTS[name]}"), name)


def connect(listener: Listener, *, rank: int, sites: list[str], addrs: list[tuple[str, int]], streams: int,
            session: bytes, timeout_s: float, **chunking: int) -> TlsComm:
    """Build the group's mesh (see build_mesh) and a TlsComm over it."""
    from trainer.transport.comm import TlsComm
    from trainer.transport.mesh import build_mesh

    mesh = build_mesh(listener, rank=rank, size=len(sites), sites=sites, addrs=addrs, streams=streams,
                      session=session, timeout_s=timeout_s)
    return TlsComm(mesh, timeout_s=timeout_s, **chunking)


__all__ = ["CollectiveMismatch", "Identity", "Listener", "Mesh", "PeerLost", "PeerRefused", "TlsComm",
           "TransportError", "build_mesh", "connect"]
