"""The run's coordinators: start the torchft Lighthouse (or the async outer service) and its TLS relay,
tell whether they still run, and end them. Used by launch and the collector (dilococtl.runs) and by
supervision's restarts (dilococtl.supervise)."""

from __future__ import annotations

import posixpath
import re
import shlex
import time
from collections.abc import Callable
from typing import Any

from dilococtl import procs
from dilococtl.errors import DilocoError
from dilococtl.nodes import NodePool
from dilococtl.plan import LIGHTHOUSE_SITE, LaunchPlan
from dilococtl.store import Run

Progress = Callable[[str], None]
LIGHTHOUSE_PORT_WAIT_S = 120.0  # how long launch waits for the Lighthouse (or outer service), then its relay, to
# listen (importing torch and torchft took ~30 s on a loaded 2-core CI machine)
# Not anchored at a line's start: torchft's logger writes to the same file, and under load its timestamp
# (written apart from the rest of its line) can land just before our lines (CI: the door went unseen, the
# relay dialled the Lighthouse's port in its private namespace and every quorum was refused for minutes).
# torchft's own "Lighthouse listening on: URL" differs in case and colon.
_LISTENING = re.compile(r"lighthouse listening on \S*:(\d+)\s*$", re.M)
_DOOR = re.compile(r"lighthouse door (/\S+)\s*$", re.M)  # trainer.service.lighthouse --door: the relay's way in
_SERVICE_READY = re.compile(r"outer service listening on https://\S*:(\d+)", re.M)
_RELAY_LOCAL = re.compile(rb"relay listening on .*; local 127\.0\.0\.1:(\d+)\s*$", re.M)


def put_files(pool: NodePool, files, host: str | None = None) -> None:
    """Copy a plan's (host, remote, local) files (async mode: the service's keys) into 0700 directories, each
    readable by its owner only; `host`: only that host's."""
    for h, remote, local in files:
        if host is not None and h != host:
            continue
        node = pool.get(h)
        node.run(f"mkdir -p -m 700 {shlex.quote(posixpath.dirname(remote))}", timeout=30)
        node.put(local, remote)
        node.run(f"chmod 600 {shlex.quote(remote)}", timeout=30)


def coordinator_name(lh) -> str:
    return "the outer parameter service" if lh.kind == "outer_service" else "the torchft Lighthouse"


def last_line(node, path: str) -> str:
    """The last line of the log at `path` on `node` ("" when unreadable): why a process exited."""
    try:
        return " ".join(node.read_from(path, 0).decode("utf-8", "replace").strip().splitlines()[-1:])
    except DilocoError:
        return ""


def start_coordinator(plan: LaunchPlan, node, run_id: str, started: list, progress: Progress,
                      loopback_port: int = 0) -> dict[str, Any]:
    """Start the run's Lighthouse (or outer service) and its relay on `node` and wait until each says it
    listens; a process that exits first (a port taken, a bad key) fails in one line naming it and its log's
    last line. Started pids go to `started` (a failed launch's cleanup). Returns the run's lighthouse record.
    `loopback_port`: the relay's loopback port to take again (a restart: the sites on its host dial it)."""
    lh = plan.lighthouse
    what = coordinator_name(lh)
    progress(f"starting {what} on {lh.host}:{lh.port}")
    if lh.config_path:
        node.write_text(lh.config_path, lh.config_toml)
    pid = node.start_detached(lh.command, lh.log_path, env=procs.marker_env(run_id))
    started.append((LIGHTHOUSE_SITE, lh.host, pid))
    ready = _SERVICE_READY if lh.kind == "outer_service" else _LISTENING
    deadline = time.monotonic() + LIGHTHOUSE_PORT_WAIT_S
    while not (m := ready.search(node.read_from(lh.log_path, 0).decode("utf-8", "replace"))):
        if not node.alive(pid) or time.monotonic() > deadline:
            if m := ready.search(node.read_from(lh.log_path, 0).decode("utf-8", "replace")):
                break
            why = "exited at start" if not node.alive(pid) else \
                f"did not report its port within {LIGHTHOUSE_PORT_WAIT_S:.0f} s"
            raise DilocoError(f"{what} on {lh.host} {why}: {last_line(node, lh.log_path)}")
        time.sleep(0.2)
    info = {"host": lh.host, "pid": pid, "url": lh.url, "log_path": lh.log_path, "kind": lh.kind}
    if lh.relay is not None:
        info.update(_start_relay(lh, node, pid, run_id, started, progress, int(m.group(1)), loopback_port))
    return info


def _start_relay(lh, node, lh_pid: int, run_id: str, started: list, progress: Progress, lh_port: int,
                 loopback_port: int = 0) -> dict[str, Any]:
    """Start the relay in front of the loopback Lighthouse `lh_pid` (listening on `lh_port` in its namespace;
    recorded in `started` for a failed launch's cleanup); its pid and log for the run's record."""
    deadline = time.monotonic() + LIGHTHOUSE_PORT_WAIT_S
    relay = lh.relay
    door = relay_target(node.read_from(lh.log_path, 0).decode("utf-8", "replace"), "--door" in lh.command)
    progress(f"starting the Lighthouse's TLS relay on {relay.host}:{lh.port}")
    target = door or lh_port
    cmd = relay.command_for(target) + (f" --local-port {int(loopback_port)}" if loopback_port else "")
    pid = node.start_detached(cmd, relay.log_path, env=procs.marker_env(run_id))
    started.append((LIGHTHOUSE_SITE, relay.host, pid))
    # listening once it says so (its imports take seconds on a busy node); dead if it exited first
    while b"relay listening on " not in (head := node.read_from(relay.log_path, 0, 1 << 16)):
        if not node.alive(pid) or time.monotonic() > deadline:
            raise DilocoError(f"the Lighthouse's relay on {relay.host} exited at start: "
                              f"{last_line(node, relay.log_path)}")
        time.sleep(0.2)
    # the host's own sites dial the relay's loopback port for the run's uid (the Lighthouse's own port is
    # in its private namespace); a relay without one (an older plan) leaves them the Lighthouse's port
    local = _RELAY_LOCAL.search(head)
    return {"relay_pid": pid, "relay_log_path": relay.log_path,
            "loopback_port": int(local.group(1)) if local else lh_port}


def relay_target(log: str, door: bool) -> str | None:
    """The door (a Unix socket path) the Lighthouse's log names, None for a Lighthouse started without one.
    Its line is written with the port's, in one write: a port without it is a log launch misread."""
    m = _DOOR.search(log)
    if door and m is None:
        raise DilocoError(f"the Lighthouse was started with a door but its log names none: {log[-300:]!r}")
    return m.group(1) if door else None


def lighthouse_pids(run: Run) -> list[int]:
    """The recorded pids of the run's Lighthouse (or outer service) and of its relay, if any."""
    return [int(run.lighthouse[k]) for k in ("pid", "relay_pid") if run.lighthouse.get(k)]


def lighthouse_alive(run: Run, pool: NodePool) -> bool:
    """Whether the run's Lighthouse (or outer service) process, and its relay if it has one, still run
    (False when unknown): a Lighthouse that lost its relay is out of the sites' reach."""
    lh = run.lighthouse
    if not lh.get("pid"):
        return False
    try:
        return all(procs.identify(pool.get(lh["host"]), pid, run.id) == "ours" for pid in lighthouse_pids(run))
    except DilocoError:
        return False


def stop_lighthouse(run: Run, pool: NodePool) -> None:
    """SIGTERM the run's Lighthouse (or outer service) and its relay; a node that does not answer is skipped."""
    lh = run.lighthouse
    for pid in lighthouse_pids(run):
        try:  # only if that pid is still the run's process (dilococtl.procs)
            procs.signal_if_ours(pool.get(lh["host"]), pid, run.id, "TERM")
        except DilocoError:
            pass


def end_lighthouse(run: Run, pool: NodePool, grace_s: float = 10.0) -> None:
    """SIGTERM the run's Lighthouse and relay, SIGKILL what is still there after `grace_s`."""
    stop_lighthouse(run, pool)
    deadline = time.monotonic() + grace_s
    left = lighthouse_pids(run)
    while left:
        left = [p for p in left if is_ours(pool, run.id, run.lighthouse["host"], p)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid in left:
        try:
            procs.signal_if_ours(pool.get(run.lighthouse["host"]), pid, run.id, "KILL")
        except DilocoError:
            pass


def is_ours(pool: NodePool, run_id: str, host: str, pid: int) -> bool:
    try:
        return procs.identify(pool.get(host), pid, run_id) == "ours"
    except DilocoError:
        return False
