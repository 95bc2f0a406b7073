"""torchft wiring: the Manager that joins a site to the cross-site quorum, and a Comm over it.

A site is one torchft replica group; each local rank exchanges with the same local rank of the
other sites through the process group `[diloco] transport` names (CPU tensors):
- "tls": trainer.transport's ProcessGroupTls, mutual TLS 1.3 under the run's CA with
  `transport_streams` connections per peer and direction; heal state travels over the same
  authenticated streams as tensors only (trainer.transport.heal), never unpickled;
- "gloo": torchft's reconfigurable ProcessGroupGloo (plaintext, one connection per peer) and its
  HTTP checkpoint transport, kept for side-by-side comparison.
torchft's Manager and Lighthouse keep the quorum and the commit vote either way. Every heal, over
either transport, is screened before torchft sees it (trainer.outer.heal_guard: the source's claimed step
against this site's commit history, the state's tensors against its own, a source once refused never
healed from again) and capped at this site's own state size; a refused heal installs nothing and
the site takes part in the round with its own state (start_quorum). With
`run.lighthouse_site` set (launch sets it for the TLS transport), the Lighthouse listens on loopback
behind a mutual-TLS relay and this site's Manager reaches it through an in-process
trainer.transport.relay.RelayClient that shows the site's certificate and accepts only a relay whose
certificate names `lighthouse_site`; a site led from the Lighthouse's own host dials its loopback port
instead (`run.lighthouse_loopback`).

What of torchft still crosses sites in plaintext, and what a process that reaches it without any
certificate of the run can do (the TLS transport; gloo exposes all of this and more):
- Each site's ManagerServer (gRPC, on its leader node, an ephemeral port; torchft hard-codes the
  bind to every interface). Its RPCs take no credentials: `Kill` makes the site's rank-0 trainer
  exit, `ShouldCommit` with false vetoes the site's commit of the round, `Quorum` for a group rank
  can disturb the site's quorum. Other sites use it only to ask a heal source for its checkpoint
  metadata, which over the TLS transport is the constant "dilococtl-tls". So on a site of one node
  (TLS transport, Lighthouse relayed) it is bound to 127.0.0.1 and that metadata is answered
  locally (trainer.modes.torchft_compat.confine_manager_server): nothing of it is reachable from another
  host. A site of several nodes needs it on the network for its other nodes: there it stays exposed,
  denial of service only (no tensor, heal state or quorum membership comes from or goes to it).
- The cross-replica TCPStore: the quorum's store_address is the primary site's torchrun rendezvous
  store (its leader node, base_port + site index, all interfaces). ProcessGroupTls publishes each
  member's site name and listener address there; a stranger can read those (no secret) or
  overwrite them, which makes the mesh dial a peer that cannot show that site's certificate: the
  quorum's configure fails and the round is not committed. It can also disturb the in-site
  rendezvous. Again denial of service only.
Closing the rest needs torchft to take credentials on those RPCs and the store (or a relay in front
of each), or a host firewall admitting only the run's hosts to those ports; neither is done here.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, AllToAllOptions

from trainer.modes import torchft_compat
from trainer.outer.heal_guard import HealGuard, HealLimits, HealRefused, screened_transport
from trainer.rules.config import TrainerConfig, cross_site_transport
from trainer.rules.diloco_config import DilocoConfig, parse_link_key

log = logging.getLogger(__name__)

GLOO_WARNING = ("diloco.transport = \"gloo\": plaintext exchange, and heal state is fetched over torchft's HTTP "
                "transport and unpickled (weights_only=False): any host that reaches a site can run code in "
                "it; use it only on a trusted network (\"tls\" is the safe transport)")
QUORUM_TIMEOUT_S = 900.0  # a (re)joining site waits this long for the others to reach a round boundary
CONNECT_TIMEOUT_S = 30.0  # RPCs to the Lighthouse and to managers
QUORUM_RETRY_S = 0.5  # a quorum request the Lighthouse failed (it died) is retried this often, on a new
# connection, until QUORUM_TIMEOUT_S: a restarted Lighthouse at the same address is found again (torchft's
# default, no retry, left the site waiting for the full quorum timeout: issue 41); well under the
# Lighthouse's join timeout, so every site's retry reaches a new Lighthouse within one join window (at 2 s
# the sites formed quorums of one apart and the next round waited the exchange timeout)
LIGHTHOUSE_PROBE_S = 5.0  # while a quorum waits, the Lighthouse is probed (HTTP GET /status) this often; a
# failed probe is a `coordinator_unreachable` event, the first good one after it `coordinator_back`; a page
# that says the other sites finished the run without this site ends the wait (trainer.service.lighthouse_status)
RUN_ENDED_KEY = "dilococtl/run_ended"  # rank 0 tells the site's other ranks, waiting on its quorum, in the site's store


class RunEnded(Exception):
    """The other sites committed the run's last round without this site and left: its quorum never forms."""


def exchange_timeout(cfg: TrainerConfig, payload_bytes: int) -> timedelta:
    """Collective timeout sized to the payload and the slowest link, not torchft's 10 s default.

    Worst case on the wire is an allgather: each site receives (K-1) payloads; allow 4x the
    ideal transfer time plus a fixed margin for round trips and stragglers.
    """
    d = cfg.diloco
    if d.timeout_s > 0:
        return timedelta(seconds=d.timeout_s)
    wire_bits = payload_bytes * max(1, d.sites - 1) * 8
    ideal = wire_bits / (d.link_mbit * 1e6)
    return timedelta(seconds=max(30.0, 15.0 + 4.0 * ideal))


class _NoFlightRecorderNote(logging.Filter):
    """torchft warns after every quorum that a CPU build of torch has no NCCL flight recorder to reset:
    true of every CPU run, and no use to anyone reading its log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Unable to reset NCCL flight recorder" not in record.getMessage()


def make_manager(cfg: TrainerConfig, timeout: timedelta, state_dict: Callable[[], dict],
                 load_state_dict: Callable[[dict], None], on_event: Callable[..., None] | None = None):
    """A torchft Manager for this site (its Lighthouse from the config or TORCHFT_LIGHTHOUSE).
    `on_event(kind, message, **detail)`: where a Lighthouse that a quorum cannot reach is reported."""
    torchft_compat.check_version()  # the trainer's first use of torchft: refuse one it was not written for
    from torchft import Manager, ProcessGroupGloo

    lighthouse = cfg.run.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
    if not lighthouse:
        raise RuntimeError("run.lighthouse: no torchft Lighthouse address (set it or TORCHFT_LIGHTHOUSE)")
    relay = None
    if cfg.run.lighthouse_site and int(os.environ.get("RANK", "0")) == 0:  # only rank 0 dials the Lighthouse
        if cfg.run.lighthouse_loopback:  # on the Lighthouse's own host: no relay between
            lighthouse = cfg.run.lighthouse_loopback
        else:
            relay = lighthouse_relay(cfg, lighthouse)
            lighthouse = f"http://127.0.0.1:{relay.port}"
    if not hasattr(torch._C._distributed_c10d, "_reset_fr_recording_nccl"):  # a CPU build
        manager_log = logging.getLogger("torchft.manager")
        if not any(isinstance(f, _NoFlightRecorderNote) for f in manager_log.filters):
            manager_log.addFilter(_NoFlightRecorderNote())
    extra = {}
    confine = False
    guard = HealGuard(own_state=state_dict, limits=HealLimits.from_config(cfg))
    if cross_site_transport(cfg) == "tls":
        pg = tls_process_group(cfg, timeout)
        from trainer.transport.heal import checkpoint_transport

        # a heal source may announce no more than a state like this site's own (finding 8)
        transport = checkpoint_transport(pg, max_bytes=guard.cap)
        # a site on one node needs its ManagerServer on loopback only (see the module docstring)
        confine = bool(cfg.run.lighthouse_site) and os.environ.get("LOCAL_WORLD_SIZE", "1") == \
            os.environ.get("WORLD_SIZE", "1")
        if confine:
            torchft_compat.confine_manager_server(transport.metadata())
            extra["hostname"] = "127.0.0.1"  # what the site's own ranks dial (and the Lighthouse records)
    else:
        from torchft.checkpointing.http_transport import HTTPTransport

        log.warning(GLOO_WARNING)
        pg = ProcessGroupGloo(timeout=timeout)
        transport = HTTPTransport(timeout=timeout, num_chunks=0)  # torchft's default, made here to be screened
    manager = Manager(
        pg=pg,
        **extra,
        checkpoint_transport=screened_transport(transport, guard),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=cfg.diloco.min_sites,
        use_async_quorum=False,  # heal before the exchange, never during it
        timeout=timeout,
        quorum_timeout=timedelta(seconds=max(QUORUM_TIMEOUT_S, timeout.total_seconds())),
        quorum_retries=int(max(QUORUM_TIMEOUT_S, timeout.total_seconds()) / QUORUM_RETRY_S),
        connect_timeout=timedelta(seconds=CONNECT_TIMEOUT_S),
        lighthouse_addr=lighthouse,
        replica_id=cfg.run.site,
        init_sync=False,  # every site initialises from the same seed
    )
    manager._dilococtl_relay = relay  # lives as long as the manager (daemon threads: exit never waits on it)
    manager._dilococtl_heal = guard
    # the site's ranks agree on each heal over a group of their own (trainer.modes.ft_exchange.settle_heal): overlap
    # mode settles heals on its exchange thread while the main thread runs the site's other collectives
    manager._dilococtl_heal_pg = dist.new_group(backend="gloo") if dist.is_initialized() and \
        dist.get_world_size() > 1 else None
    # the guard learns each quorum and vote
    client = torchft_compat.wrap_manager_client(manager, lambda real: _VoteWatch(real, guard, manager))
    rank0 = int(os.environ.get("RANK", "0")) == 0
    store = dist.distributed_c10d._get_default_store() if dist.is_initialized() and dist.get_world_size() > 1 else None
    if rank0 or store is not None:
        client.stall = _QuorumWatch(lighthouse if rank0 else "", on_event if rank0 else None,
                                    site=cfg.run.site, store=store)
    manager._dilococtl_lighthouse = lighthouse  # as rank 0 reaches it (the relay's port): announce_end
    return manager


def announce_end(manager, site: str) -> None:
    """Tell the Lighthouse this site finished the run (one heartbeat as SITE:dilococtl-ended), so a
    straggler waiting for a quorum that can no longer form stops (trainer.service.lighthouse_status). Rank 0
    only; best effort: a Lighthouse that does not answer leaves the straggler to torchft's timeout."""
    from torchft.coordination import LighthouseClient

    from trainer.service.lighthouse_status import ENDED

    try:
        LighthouseClient(manager._dilococtl_lighthouse, connect_timeout=timedelta(seconds=5)).heartbeat(
            f"{site}:{ENDED}", timeout=timedelta(seconds=5))
    except Exception as e:  # the run is over either way
        log.warning("could not tell the Lighthouse this site finished: %s", e)


class _VoteWatch(torchft_compat.ManagerClientProxy):
    """torchft's ManagerClient, except that each quorum result and commit vote is also shown to the
    site's HealGuard (torchft keeps neither where a checkpoint transport could read it)."""

    def __init__(self, real, guard: HealGuard, manager):
        super().__init__(real)
        self._guard, self._manager = guard, manager
        self.stall: _QuorumWatch | None = None  # reports a Lighthouse the quorum cannot reach, and the run's end

    def quorum(self, **kw):
        self._guard.before = self._manager.state_dict()  # what undo_heal restores
        if self.stall is not None:
            result = self.stall.wait(lambda: self.real_quorum(**kw), kw.get("step", 0))
        else:
            result = self.real_quorum(**kw)
        self._guard.note_quorum(kw["step"], result)
        return _EpochQuorum(result)

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: timedelta) -> bool:
        ok = super().should_commit(group_rank, step, should_commit, timeout=timeout)
        self._guard.note_commit(step, ok)
        return ok


class _EpochQuorum:
    """A quorum result whose store address carries the quorum's max step as a prefix.

    torchft keys each quorum's rendezvous in the primary site's store under /torchft/QUORUM_ID/..., and a
    restarted Lighthouse counts quorum ids from the start again: the sites then read the previous
    Lighthouse's keys for the same id (a dead listener's address) and the round failed after the exchange
    timeout (issue 41). Every member of a quorum gets the same max step, and a new quorum id is configured
    at a step no earlier quorum of that id was configured at (unless the Lighthouse died in the very round
    it formed), so STEP/torchft/ID/... is fresh."""

    def __init__(self, real):
        self._real = real
        self.store_address = f"{real.store_address}/s{int(real.max_step)}"

    def __getattr__(self, name: str):
        return getattr(self._real, name)


class _QuorumWatch:
    """While a quorum waits, rank 0 probes the Lighthouse every LIGHTHOUSE_PROBE_S. It reports the first
    failed probe (`coordinator_unreachable`, with since when) and the first good one after it
    (`coordinator_back`), so a site that waits on a dead coordinator says so within a few heartbeats
    (issue 41); and when the page says the other sites finished the run without this site and left
    (trainer.service.lighthouse_status, announce_end), the wait ends in RunEnded at every rank of the site (the
    others read it from the site's store) instead of at torchft's quorum timeout."""

    def __init__(self, url: str, on_event: Callable[..., None] | None, site: str, store=None):
        self.url = url.rstrip("/") + "/status" if url else ""  # "": not rank 0, the store says
        self.on_event = on_event or (lambda *a, **k: None)
        self.site, self.store = site, store
        self.since: float | None = None  # when the first failed probe of this outage was
        self.ended: str | None = None  # why the run is over for this site

    def probe(self) -> tuple[str, str]:
        """("", the status page) when the Lighthouse answers, else (why not in one line, "")."""
        import urllib.request

        try:
            with urllib.request.urlopen(self.url, timeout=2.0) as r:
                return "", r.read(1 << 20).decode("utf-8", "replace")
        except Exception as e:  # any failure to answer is the news (refused, reset, timeout, HTTP error)
            return " ".join(str(getattr(e, "reason", e) or type(e).__name__).split()), ""

    def _check(self, step: int) -> None:
        import time

        from trainer.service.lighthouse_status import ended_without

        if not self.url:
            if self.store is not None and self.store.check([RUN_ENDED_KEY]):
                self.ended = self.store.get(RUN_ENDED_KEY).decode()
            return
        why, page = self.probe()
        if why and self.since is None:
            self.since = time.time()
            self.on_event("coordinator_unreachable",
                          f"the quorum at step {step} waits: cannot reach the Lighthouse ({why}) since "
                          f"{time.strftime('%H:%M:%S', time.gmtime(self.since))} UTC", since=self.since, why=why)
        elif not why:
            self._back()
            if (ended := ended_without(page, self.site)) is not None:
                if self.store is not None:
                    self.store.set(RUN_ENDED_KEY, ended)
                self.ended = ended

    def _back(self) -> None:
        import time

        if self.since is not None:
            self.on_event("coordinator_back", f"the Lighthouse answers again after {time.time() - self.since:.0f} s",
                          since=self.since, seconds=round(time.time() - self.since, 1))
            self.since = None

    def wait(self, fn: Callable[[], object], step: int):
        """fn() (the quorum RPC), checked on the side every LIGHTHOUSE_PROBE_S (rank 0) or second (the
        store) while it waits; RunEnded as soon as the run is found over (fn stays blocked in its daemon
        thread until the process exits). A Lighthouse that was unreachable is reported back at the end."""
        import threading

        box: list = []
        done = threading.Event()

        def call() -> None:
            try:
                box.append((True, fn()))
            except BaseException as e:  # handed to the waiting thread
                box.append((False, e))
            done.set()

        def check() -> None:
            while not done.wait(LIGHTHOUSE_PROBE_S if self.url else 1.0) and self.ended is None:
                self._check(step)

        threading.Thread(target=call, daemon=True, name="quorum-rpc").start()
        threading.Thread(target=check, daemon=True, name="quorum-watch").start()
        try:
            while not done.wait(0.2):
                if self.ended is not None:
                    raise RunEnded(self.ended)
        finally:
            done.set()  # the checker stops
            self._back()  # the quorum got through: the Lighthouse is back
        ok, value = box[0]
        if not ok:
            raise value
        return value


def undo_heal(manager, reason: str, exclude: bool = True) -> HealRefused:
    """Put back the manager's step and count as they were before this quorum's heal (which another rank
    of the site refused or did not receive); `exclude`: refuse the source from now on here too."""
    guard: HealGuard = manager._dilococtl_heal
    manager.load_state_dict(guard.before)
    source = guard.view.source if guard.view is not None else "the heal source"
    if exclude:
        guard.refused.setdefault(source, reason)
    return HealRefused(source, reason)


def start_quorum(manager) -> HealRefused | None:
    """manager.start_quorum(), and the heal it refused, if any (trainer.outer.heal_guard).

    torchft reports a failed recovery as the quorum's error, which would fail the round; a refused
    heal installed nothing (not even torchft's step), so the error is cleared and the site takes
    part in the round with its own state. Any other error stays.
    """
    manager.start_quorum()
    err = manager.errored()
    if err is not None and isinstance(err.original_exception, HealRefused):
        torchft_compat.clear_manager_error(manager)
        return err.original_exception
    return None


def lighthouse_relay(cfg: TrainerConfig, url: str):
    """A RelayClient on 127.0.0.1 (ephemeral port) to the Lighthouse relay at `url`, showing this site's
    certificate and requiring one that names run.lighthouse_site."""
    from urllib.parse import urlsplit

    from trainer.rules.config import has_identity
    from trainer.transport import Identity
    from trainer.transport.relay import RelayClient

    r = cfg.run
    if not has_identity(cfg):
        raise RuntimeError(f"run.lighthouse_site: the Lighthouse is behind a TLS relay ({r.lighthouse_site}) but "
                           f"this site has no identity (run.tls_ca, tls_cert, tls_key)")
    try:
        u = urlsplit(url)
        host, port = u.hostname, u.port
    except ValueError:
        host = port = None
    if not host or not port:
        raise RuntimeError(f"run.lighthouse: {url!r} names no host and port")
    ident = Identity(site=r.site, cert=r.tls_cert, key=r.tls_key, ca=r.tls_ca)
    return RelayClient(ident, server=(host, port), expect=r.lighthouse_site)


def link_paces_from(d: DilocoConfig, site: str) -> dict[str, float]:
    """diloco.transport_link_pace_mbit's links out of `site`: destination site -> Mbit/s."""
    return {dst: mbit for key, mbit in d.transport_link_pace_mbit.items()
            for src, dst in [parse_link_key(key)] if src == site}


def transport_note(cfg: TrainerConfig) -> str:
    """One line on this site's cross-site transport: its streams and the pace of each link out of it."""
    if cfg.diloco.mode == "async":
        return "transport: the outer service (async mode)"
    if cross_site_transport(cfg) != "tls":
        return "transport gloo (WARNING: plaintext, heal state unpickled from peers: trusted networks only)"
    d = cfg.diloco
    paced = ", ".join(f"{dst} {m:g} Mbit/s" if m else f"{dst} unpaced"
                      for dst, m in link_paces_from(d, cfg.run.site).items())
    rest = f"{d.transport_pace_mbit:g} Mbit/s" if d.transport_pace_mbit else "unpaced"
    head = f"transport tls, {d.transport_streams} streams per peer and direction; "
    if paced:
        return head + f"paced to {paced}, other sites {rest}"
    return head + (f"paced to {rest} to every site" if d.transport_pace_mbit else "unpaced")


def tls_process_group(cfg: TrainerConfig, timeout: timedelta):
    """This site's ProcessGroupTls (listening from now on) with the identity run.tls_* name."""
    from trainer.transport import Identity
    from trainer.transport.pg import ProcessGroupTls

    r = cfg.run
    ident = Identity(site=r.site, cert=r.tls_cert, key=r.tls_key, ca=r.tls_ca)
    # every local rank exchanges with its peers of the other sites on a listener of its own
    port = r.transport_port + int(os.environ.get("LOCAL_RANK", "0")) if r.transport_port else 0
    return ProcessGroupTls(ident, timeout=timeout, streams=cfg.diloco.transport_streams,
                           port=port, host=r.transport_host, pace_mbit=cfg.diloco.transport_pace_mbit,
                           link_pace=link_paces_from(cfg.diloco, r.site),
                           congestion=cfg.diloco.transport_congestion,
                           clear_loopback=cfg.diloco.transport_loopback_clear)


def cross_site_comm(manager, timeout: timedelta) -> TorchftComm:
    """The Comm of the quorum `manager` has just formed (call after start_quorum), whatever the
    transport: its size and rank are the quorum's; a failed collective is reported to the manager
    (the round is not committed) and raised."""
    return TorchftComm(manager, timeout)


class TorchftComm:
    """Comm over the manager's cross-site process group, for one quorum.

    A failed collective is reported to the manager (so the round is not committed) and raised.
    """

    def __init__(self, manager, timeout: timedelta):
        self.manager = manager
        self.pg = torchft_compat.manager_process_group(manager)  # torchft has no public handle for allgather
        self.timeout = timeout
        self.size = self.pg.size()
        # torchft's wrapper keeps the rank of its construction; the configured gloo group knows the
        # real one (ProcessGroupTls answers rank() itself)
        self.rank = getattr(self.pg, "parent", self.pg).rank()

    def _wait(self, start: Callable[[], object]) -> None:
        # the TLS group fails in the call itself (it is synchronous), gloo in the wait
        try:
            start().wait(self.timeout)
        except Exception as e:
            self.manager.report_error(e)
            raise

    def allreduce_sum(self, t: torch.Tensor) -> None:
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        self._wait(lambda: self.pg.allreduce([t], opts))

    def allgather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(self.size)]
        self._wait(lambda: self.pg.allgather([out], [t], AllgatherOptions()))
        return out

    def alltoall(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(t)
        self._wait(lambda: self.pg.alltoall_base(out, t, [], [], AllToAllOptions()))
        return out
