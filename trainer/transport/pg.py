"""`ProcessGroupTls`: a torchft ProcessGroup whose collectives run over the TLS transport.

torchft's Manager calls `configure(store_addr, replica_id, rank, world_size, ...)` at every new
quorum with a store prefix unique to that quorum. Each member writes its listener's address and
its site name under that prefix, reads everyone's, and builds a fresh mesh (`build_mesh`); the
session id is a hash of the prefix, so streams of two quorums never mix. The store itself is not
trusted: an address written there by a stranger leads to a peer that cannot show a certificate
of this run for that site name, and is refused.

The collectives are synchronous: each returns a completed Work, or raises (the comm is then
failed, `errored()` says so, and torchft does not commit the round).
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
from datetime import timedelta

import torch
from torch.distributed import ReduceOp, Work
from torchft.process_group import ProcessGroup, create_store_client

from trainer.modes.torchft_compat import dummy_work
from trainer.transport.comm import CHUNK_BYTES, TlsComm
from trainer.transport.mesh import Listener, build_mesh
from trainer.transport.tls import Identity, TransportError

log = logging.getLogger(__name__)


def advertised_host(host: str) -> str:
    """The address peers dial: `host`, or this node's hostname resolved (each lab node has its own)."""
    if host:
        return host
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError:
        return name


class ProcessGroupTls(ProcessGroup):
    """Reconfigurable cross-site group over mutual TLS 1.3, S streams per peer and direction."""

    def __init__(self, identity: Identity, *, timeout: timedelta, streams: int = 4, bind: str = "0.0.0.0",
                 port: int = 0, host: str = "", chunk_bytes: int = CHUNK_BYTES, pace_mbit: float = 0.0,
                 link_pace: dict[str, float] | None = None, congestion: str = "", clear_loopback: bool = False):
        super().__init__(0, 1)
        self.identity = identity
        self.timeout = timeout
        self.streams = streams
        self.chunk_bytes = chunk_bytes
        self.pace_mbit = pace_mbit  # the streams to every peer paced to this total (0: unpaced) ...
        self.link_pace = dict(link_pace or {})  # ... but to a peer of the site named here, to its own
        self.congestion = congestion
        self.listener = Listener(identity, host=bind, port=port, clear_loopback=clear_loopback)
        self.host = advertised_host(host)
        self.comm: TlsComm | None = None
        self._rank = 0
        self._size = 1
        self._error: Exception | None = None

    # -- torchft's reconfiguration -----------------------------------------------------------

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, quorum_id=None,
                  group_rank=None, group_world_size=None, global_ranks=None) -> None:
        self.abort()
        self._error = None
        t = self.timeout.total_seconds()
        store = create_store_client(store_addr, timeout=self.timeout)
        me = {"site": self.identity.site, "host": self.host, "port": self.listener.port}
        store.set(f"dilococtl-tls/{rank}", json.dumps(me))
        sites, addrs = [], []
        for r in range(world_size):
            try:
                entry = json.loads(store.get(f"dilococtl-tls/{r}"))  # waits for rank r, up to the timeout
                site, host, port = str(entry["site"]), str(entry["host"]), int(entry["port"])
            except (ValueError, KeyError, TypeError) as e:
                raise TransportError(f"quorum member {r} published no usable transport address: {e}") from None
            if not 0 < port < 65536:
                raise TransportError(f"quorum member {r} published port {port}")
            sites.append(site)
            addrs.append((host, port))
        session = hashlib.sha256(f"dilococtl-tls|{store_addr}|{quorum_id}".encode()).digest()[:16]
        mesh = build_mesh(self.listener, rank=rank, size=world_size, sites=sites, addrs=addrs,
                          streams=self.streams, session=session, timeout_s=t)
        try:
            # a peer's site name is its certificate's (build_mesh refused any other)
            peer_pace = {p: self.link_pace[sites[p]] for p in mesh.links if sites[p] in self.link_pace}
            self.comm = TlsComm(mesh, timeout_s=t, chunk_bytes=self.chunk_bytes, pace_mbit=self.pace_mbit,
                                peer_pace=peer_pace, congestion=self.congestion)
        except BaseException:
            mesh.close()
            raise
        self._rank, self._size = rank, world_size
        log.info("transport: rank %d of %d (%s), %d streams per peer and direction", rank, world_size,
                 ", ".join(sites), self.streams)

    def rank(self) -> int:  # torchft's BaseProcessGroup keeps the rank of its construction
        return self._rank

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:
        return "dilococtl-tls"

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout = timeout

    def errored(self) -> Exception | None:
        return self._error

    def abort(self) -> None:
        if self.comm is not None:
            self.comm.close()
            self.comm = None

    def shutdown(self) -> None:
        self.abort()
        self.listener.close()

    # -- collectives ---------------------------------------------------------------------------

    def live(self) -> TlsComm:
        """The comm of the current quorum; TransportError when none is configured."""
        if self.comm is None:
            raise TransportError("the transport is not configured for a quorum")
        return self.comm

    def _do(self, fn, result):
        try:
            fn(self.live())
        except Exception as e:
            self._error = e
            raise
        return dummy_work(result)

    def allreduce(self, tensors: list[torch.Tensor], opts) -> Work:
        op = opts if isinstance(opts, ReduceOp) else getattr(opts, "reduceOp", ReduceOp.SUM)
        if op != ReduceOp.SUM:
            raise ValueError(f"the TLS transport sums; {op} is not supported")

        def run(c: TlsComm) -> None:
            for t in tensors:
                c.allreduce_sum(t)
        return self._do(run, tensors)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensor: list[torch.Tensor], opts) -> Work:
        def run(c: TlsComm) -> None:
            for outs, t in zip(output_tensors, input_tensor, strict=True):
                for o, g in zip(outs, c.allgather(t), strict=True):
                    o.copy_(g)
        return self._do(run, output_tensors)

    def alltoall_base(self, output_buffer: torch.Tensor, input_buffer: torch.Tensor, output_split_sizes,
                      input_split_sizes, opts) -> Work:
        if output_split_sizes or input_split_sizes:
            raise ValueError("the TLS transport's alltoall takes equal parts only")
        return self._do(lambda c: output_buffer.copy_(c.alltoall(input_buffer.view(-1)).view_as(output_buffer)),
                        [output_buffer])

    def barrier(self, opts=None) -> Work:
        return self._do(lambda c: c.allgather(torch.zeros(1)), None)


__all__ = ["ProcessGroupTls", "advertised_host"]
