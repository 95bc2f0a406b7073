"""The fault primitives of `dilococtl lab chaos`: what each fault does to the lab and how it is undone.

Link faults are iptables rules in the core (dilococtl.lab.ops: CHAOS_CHAIN) and tbf/delayer changes
(ops.shape); `slow` is a SIGSTOP/SIGCONT duty cycle over a node's processes; `kill` is ops.kill. The
Ledger holds the undo of everything applied and not yet restored, so an interrupted replay can put
every link and process back as it found it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable

from dilococtl.lab import model, netns, ops
from dilococtl.lab.model import LabState, LinkShape, LinkSpec

DUTY_PERIOD_S = 0.1  # slow: one SIGSTOP/SIGCONT cycle per 100 ms
PID_REFRESH_S = 1.0  # slow: look for new processes of the nodes this often (a relaunched site's)

_shape_lock = threading.Lock()  # ops.shape reads, changes and saves the lab state: one at a time


class Ledger:
    """What chaos changed and has not restored yet: key -> its undo."""

    def __init__(self) -> None:
        self._undo: dict[str, Callable[[], object]] = {}
        self._lock = threading.Lock()

    def add(self, key: str, undo: Callable[[], object]) -> None:
        with self._lock:
            self._undo[key] = undo

    def restore(self, key: str) -> object:
        """Undo one change now; returns what its undo returned (None if it was not applied)."""
        with self._lock:
            undo = self._undo.pop(key, None)
        return undo() if undo is not None else None

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._undo)

    def restore_all(self) -> list[str]:
        """Undo everything, newest first; returns one line per undo that failed (the others still run)."""
        errors = []
        for key in reversed(self.keys()):
            try:
                self.restore(key)
            except Exception as e:  # one failed restore must not leave the others applied
                errors.append(f"{key}: {e}")
        return errors


# --- links ---------------------------------------------------------------------------------------

def pairs(state: LabState, sites: tuple[str, ...]) -> list[tuple[str, str]]:
    """The site pairs a link target covers: (a, b) itself, or every pair with the one site."""
    if len(sites) == 2:
        return [(sites[0], sites[1])]
    return [(sites[0], s.name) for s in state.sites if s.name != sites[0]]


def cut(state: LabState, sites: tuple[str, ...]) -> None:
    ops.chaos_chain(state)
    for a, b in pairs(state, sites):
        ops.cut_pair(state, a, b)


def heal(state: LabState, sites: tuple[str, ...]) -> None:
    for a, b in pairs(state, sites):
        ops.heal_pair(state, a, b)


def add_loss(state: LabState, sites: tuple[str, ...], percent: float) -> None:
    ops.chaos_chain(state)
    ops.add_loss(state, sites[0], sites[1], percent)


def remove_loss(state: LabState, sites: tuple[str, ...], percent: float) -> int:
    return ops.remove_loss(state, sites[0], sites[1], percent)


def degrade(a: str, b: str, *, rate: str, rtt: str) -> dict[str, LinkShape]:
    """Set both directions of a-b to `rate`/`rtt` (absolute as `lab shape` takes them, or "3x" of the
    direction's present value; "" keeps it); returns the shapes before, for `restore_shapes`."""
    with _shape_lock:
        before = {k: model.require().links[k] for k in (model.link_key(a, b), model.link_key(b, a))}
        for key, old in before.items():
            src, dst = key.split(">")
            ops.shape(LinkSpec(src=src, dst=dst, both=False, rate_bit=scaled_rate(rate, old.rate_bit),
                               rtt_ms=scaled_rtt(rtt, old.delay_ms * 2)))
    return before


def restore_shapes(before: dict[str, LinkShape]) -> None:
    with _shape_lock:
        for key, old in before.items():
            src, dst = key.split(">")
            ops.shape(LinkSpec(src=src, dst=dst, both=False, rate_bit=old.rate_bit, rtt_ms=old.delay_ms * 2))


def scaled_rate(text: str, now_bit: int) -> int:
    if not text:
        return now_bit
    if text.endswith("x"):
        return max(8000, int(round(now_bit * float(text[:-1]))))
    return model.parse_rate(text)


def scaled_rtt(text: str, now_ms: float) -> float | None:
    if not text:
        return None
    if text.endswith("x"):
        return min(10_000.0, now_ms * float(text[:-1]))
    return model.parse_duration_ms(text)


# --- processes -----------------------------------------------------------------------------------

def _ns_key(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def node_processes(netns_names: list[str]) -> set[int]:
    """Every process of these node namespaces but sshd, as kill_ns_processes finds them: in the
    network namespace, or in its UTS namespace (a Lighthouse moved to a network namespace of its own)."""
    nets = {k for k in (_ns_key(f"/run/netns/{n}") for n in netns_names) if k}
    pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    members = {p for p in pids if _ns_key(f"/proc/{p}/ns/net") in nets}
    utss = {_ns_key(f"/proc/{p}/ns/uts") for p in members} - {_ns_key("/proc/self/ns/uts"), None}
    if utss:
        members |= {p for p in pids if _ns_key(f"/proc/{p}/ns/uts") in utss}
    return {p for p in members if p != os.getpid() and netns.exe_of(p) not in (netns.SSHD, "")}


def _signal(pids: set[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


class DutyCycle(threading.Thread):
    """Lets the processes of some node namespaces run 1/factor of the time: SIGSTOP for
    (1 - 1/factor) of each DUTY_PERIOD_S, SIGCONT for the rest. Every process it ever stopped gets
    SIGCONT when it ends, whatever ended it."""

    def __init__(self, netns_names: list[str], factor: float):
        super().__init__(daemon=True, name=f"slow-{'+'.join(netns_names)}")
        self.netns_names = netns_names
        self.off_s = DUTY_PERIOD_S * (1 - 1 / factor)
        self.on_s = DUTY_PERIOD_S - self.off_s
        self.stopped: set[int] = set()  # every pid it sent SIGSTOP
        self.stopped_s = 0.0  # time spent in the stopped phase
        self.cycles = 0
        self.error = ""
        self._done = threading.Event()
        self._lock = threading.Lock()  # no SIGSTOP once `stop` has begun
        self._closed = False

    def run(self) -> None:
        pids: set[int] = set()
        next_refresh = 0.0
        try:
            while not self._done.is_set():
                if time.monotonic() >= next_refresh:
                    pids = node_processes(self.netns_names)
                    next_refresh = time.monotonic() + PID_REFRESH_S
                with self._lock:
                    if self._closed:
                        break
                    self.stopped |= pids
                    _signal(pids, signal.SIGSTOP)
                t = time.monotonic()
                self._done.wait(self.off_s)
                _signal(self.stopped, signal.SIGCONT)
                self.stopped_s += time.monotonic() - t
                self.cycles += 1
                self._done.wait(self.on_s)
        except Exception as e:  # the duty cycle ends; `stop` still continues everything
            self.error = str(e) or type(e).__name__
        finally:
            _signal(self.stopped, signal.SIGCONT)

    def stop(self) -> None:
        """End the cycle and SIGCONT every process it stopped (twice: before and after the thread ends)."""
        with self._lock:
            self._closed = True
        self._done.set()
        self.join(5.0)
        _signal(self.stopped, signal.SIGCONT)


def stopped_processes(netns_names: list[str]) -> list[int]:
    """Processes of these node namespaces in state T (stopped): none should be, once chaos is done."""
    out = []
    for pid in node_processes(netns_names):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    out.append(pid)
        except (OSError, IndexError):
            continue
    return sorted(out)
