"""`dilococtl lab chaos SCENARIO.toml`: the scenario of faults, its validation and its schedule.

A scenario is TOML, one `[[fault]]` table per fault, times from the run's start:

    jitter = "5s"          # optional: each `at` moves by U[-jitter, +jitter] drawn from --seed
    [[fault]]
    at = "90s"             # "90s", "3m", "1m30s", "500ms" or a number of seconds
    kind = "kill"          # kill | cut | degrade | loss | flap | slow
    target = "site2"       # a site, a node, or a link "A-B", as the kind takes
    restart_after = "20s"  # kind's own keys (KEYS below)

Everything is checked before anything is applied: a bad scenario is one BadInput line naming the
fault. dilococtl/lab/chaos.py replays the schedule against a run and restores what it changed; the
fault primitives are dilococtl/lab/faults.py.
"""

from __future__ import annotations

import math
import random
import re
import secrets
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dilococtl.errors import BadInput
from dilococtl.lab.model import LabState

KINDS = ("kill", "cut", "degrade", "loss", "flap", "slow")
COMMON = ("at", "kind", "target")
KEYS: dict[str, tuple[str, ...]] = {  # kind -> its own keys (optional ones in OPTIONAL)
    "kill": ("restart_after", "grace"),
    "cut": ("for",),
    "degrade": ("for", "rate", "rtt"),
    "loss": ("for", "percent"),
    "flap": ("for", "period"),
    "slow": ("for", "factor"),
}
OPTIONAL = {"restart_after", "grace", "rate", "rtt", "period"}
TOP_KEYS = ("fault", "jitter", "description")
MAX_AT_S = 7 * 86400.0  # a fault a week into a run is a typo, not a plan
MAX_FOR_S = 86400.0  # longest fault, relaunch delay
MAX_JITTER_S = 3600.0
MAX_GRACE_S = 600.0
DEFAULT_GRACE_S = 5.0  # kill: SIGTERM, SIGKILL after this (as `lab kill --grace`)
DEFAULT_PERIOD_S = 10.0  # flap: cut half of each period
MIN_PERIOD_S = 1.0  # flap: each toggle is a few iptables calls
MAX_LOSS_PERCENT = 50.0
MAX_SLOW_FACTOR = 20.0
MAX_SCALE = 1000.0  # degrade "Nx": at most this many times the link's present rate or RTT
KILL_SPAN_S = 60.0  # conflicts: how long a relaunch may take after restart_after

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNIT_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(kw_only=True, slots=True)
class Fault:
    index: int  # 1-based position in the scenario: how messages and --json name it
    kind: str  # one of KINDS
    target: str  # as written
    at_s: float  # seconds from the run's start, as written (before jitter)
    for_s: float = 0.0  # how long it lasts (kill: 0)
    restart_after_s: float | None = None  # kill: relaunch the site this long after the kill (None: never)
    grace_s: float = DEFAULT_GRACE_S  # kill: SIGTERM -> SIGKILL
    rate: str = ""  # degrade: "10mbit" or "0.5x" ("" keeps the rate)
    rtt: str = ""  # degrade: "240ms" or "3x" ("" keeps the RTT)
    percent: float = 0.0  # loss: % of packets dropped, each direction
    period_s: float = DEFAULT_PERIOD_S  # flap
    factor: float = 1.0  # slow: runs 1/factor of the time
    sites: tuple[str, ...] = ()  # the link's two sites, or the one site (slow/kill of a node: its site)
    nodes: tuple[str, ...] = ()  # kill, slow: the lab nodes it hits

    @property
    def link(self) -> bool:
        return self.kind in ("cut", "degrade", "loss", "flap")

    @property
    def site(self) -> str:
        """The site for the run's events ("" for a link between two)."""
        return self.sites[0] if len(self.sites) == 1 else ""

    def describe(self) -> str:
        """'cut site0-site1 for 30s', as events and progress lines say it."""
        what = f"{self.kind} {self.target}"
        if self.kind == "kill":
            return what + (f", relaunch after {fmt_s(self.restart_after_s)}" if self.restart_after_s is not None
                           else ", no relaunch")
        extra = {"degrade": " to " + "/".join(x for x in (self.rate and f"rate {self.rate}",
                                                           self.rtt and f"rtt {self.rtt}") if x),
                 "loss": f" {self.percent:g}%", "flap": f" every {fmt_s(self.period_s)}",
                 "slow": f" {self.factor:g}x"}.get(self.kind, "")
        return f"{what}{extra} for {fmt_s(self.for_s)}"


@dataclass(kw_only=True, slots=True)
class Scenario:
    path: str
    faults: list[Fault]
    jitter_s: float = 0.0
    description: str = ""


@dataclass(kw_only=True, slots=True)
class Planned:
    fault: Fault
    at_s: float  # when it is due, seconds from the run's start (jitter applied)


@dataclass(kw_only=True, slots=True)
class Schedule:
    seed: int
    jitter_s: float
    items: list[Planned] = field(default_factory=list)  # in the order they are due

    def to_json(self) -> list[dict[str, Any]]:
        return [{"index": p.fault.index, "kind": p.fault.kind, "target": p.fault.target, "at": p.fault.at_s,
                 "planned_at": round(p.at_s, 3), "for": p.fault.for_s, "what": p.fault.describe()}
                for p in self.items]


def fmt_s(s: float | None) -> str:
    """90 -> '1m30s', 30 -> '30s', 0.5 -> '0.5s'."""
    if s is None:
        return "-"
    if s >= 60 and abs(s - round(s)) < 1e-9:
        m, r = divmod(int(round(s)), 60)
        return f"{m}m{r}s" if r else f"{m}m"
    return f"{round(s, 3):g}s"


# --- parsing -------------------------------------------------------------------------------------

def load(path: Path, state: LabState) -> Scenario:
    """Read and check SCENARIO.toml against the lab; BadInput (one line) on the first problem."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise BadInput(f"{path}: cannot read the scenario ({e.strerror or e})") from None
    return parse(text, state, path=str(path))


def parse(text: str, state: LabState, *, path: str = "scenario") -> Scenario:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise BadInput(f"{path}: not valid TOML ({e})") from None
    unknown = sorted(set(doc) - set(TOP_KEYS))
    if unknown:
        raise BadInput(f"{path}: unknown top-level key {unknown[0]!r} (allowed: {', '.join(TOP_KEYS)})")
    tables = doc.get("fault")
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise BadInput(f"{path}: no faults: write one [[fault]] table per fault")
    jitter = duration(doc["jitter"], f"{path}: jitter", MAX_JITTER_S) if "jitter" in doc else 0.0
    desc = doc.get("description", "")
    if not isinstance(desc, str):
        raise BadInput(f"{path}: description must be a string")
    faults = [_fault(i, t, state) for i, t in enumerate(tables, start=1)]
    _check_conflicts(faults, jitter, state)
    return Scenario(path=path, faults=faults, jitter_s=jitter, description=desc)


def duration(value: Any, what: str, most: float) -> float:
    """'90s', '3m', '1m30s', '500ms', '1h' or a number of seconds -> seconds in [0, most]."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise BadInput(f"{what}: {value!r} is not a duration (e.g. \"90s\", \"1m30s\" or a number of seconds)")
    if isinstance(value, str):
        text = value.strip().lower()
        parts = _DURATION.findall(text)
        if not parts or "".join(n + u for n, u in parts) != text:
            raise BadInput(f"{what}: bad duration {value!r} (e.g. \"90s\", \"3m\", \"1m30s\", \"500ms\")")
        seconds = sum(float(n) * _UNIT_S[u] for n, u in parts)
    else:
        seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise BadInput(f"{what}: {value!r} must be a finite number of seconds >= 0")
    if seconds > most:
        raise BadInput(f"{what}: {value!r} is longer than the most allowed ({fmt_s(most)})")
    return seconds


def _number(value: Any, what: str, low: float, high: float, low_open: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadInput(f"{what}: {value!r} is not a number")
    v = float(value)
    if not math.isfinite(v) or v > high or v < low or (low_open and v == low):
        raise BadInput(f"{what}: {value!r} must be in {'(' if low_open else '['}{low:g}, {high:g}]")
    return v


def _fault(index: int, t: dict[str, Any], state: LabState) -> Fault:
    kind = t.get("kind")
    label = f"fault {index}" + (f" ({kind})" if isinstance(kind, str) and kind in KINDS else "")
    if kind is None:
        raise BadInput(f"{label}: missing key 'kind' (one of {', '.join(KINDS)})")
    if kind not in KINDS:
        raise BadInput(f"{label}: unknown kind {kind!r} (one of {', '.join(KINDS)})")
    allowed = (*COMMON, *KEYS[kind])
    unknown = sorted(set(t) - set(allowed))
    if unknown:
        raise BadInput(f"{label}: unknown key {unknown[0]!r} (a {kind} takes {', '.join(allowed)})")
    missing = [k for k in allowed if k not in t and k not in OPTIONAL]
    if missing:
        raise BadInput(f"{label}: missing key {missing[0]!r}")
    if not isinstance(t["target"], str) or not t["target"].strip():
        raise BadInput(f"{label}: target must be a non-empty string")
    f = Fault(index=index, kind=kind, target=t["target"].strip(), at_s=duration(t["at"], f"{label}: at", MAX_AT_S))
    if "for" in t:
        f.for_s = duration(t["for"], f"{label}: for", MAX_FOR_S)
        if f.for_s <= 0:
            raise BadInput(f"{label}: for must be longer than 0s")
    if kind == "kill":
        if "restart_after" in t:
            f.restart_after_s = duration(t["restart_after"], f"{label}: restart_after", MAX_FOR_S)
        if "grace" in t:
            f.grace_s = duration(t["grace"], f"{label}: grace", MAX_GRACE_S)
    elif kind == "degrade":
        f.rate, f.rtt = (_shape_arg(t.get(k, ""), f"{label}: {k}", k) for k in ("rate", "rtt"))
        if not f.rate and not f.rtt:
            raise BadInput(f"{label}: a degrade needs rate and/or rtt")
    elif kind == "loss":
        f.percent = _number(t["percent"], f"{label}: percent", 0.0, MAX_LOSS_PERCENT)
    elif kind == "flap":
        if "period" in t:
            f.period_s = duration(t["period"], f"{label}: period", MAX_FOR_S)
        if f.period_s < MIN_PERIOD_S:
            raise BadInput(f"{label}: period must be at least {fmt_s(MIN_PERIOD_S)}")
        if f.period_s > f.for_s:
            raise BadInput(f"{label}: period ({fmt_s(f.period_s)}) is longer than for ({fmt_s(f.for_s)})")
    elif kind == "slow":
        f.factor = _number(t["factor"], f"{label}: factor", 1.0, MAX_SLOW_FACTOR)
    _resolve(f, state, label)
    return f


def _shape_arg(value: Any, what: str, key: str) -> str:
    """degrade's rate/rtt: as `lab shape` takes them, or "Nx" of the link's present value."""
    from dilococtl.lab import model

    if value == "":
        return ""
    if not isinstance(value, str):
        raise BadInput(f"{what}: {value!r} must be a string (e.g. \"10mbit\" / \"240ms\", or \"3x\")")
    text = value.strip().lower()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)x", text)
    if m:
        scale = float(m.group(1))
        if not 0 < scale <= MAX_SCALE:
            raise BadInput(f"{what}: {value!r}: the factor must be in (0, {MAX_SCALE:g}]")
        return text
    try:
        (model.parse_rate if key == "rate" else model.parse_duration_ms)(text)
    except BadInput as e:
        raise BadInput(f"{what}: {e}") from None
    return text


def _resolve(f: Fault, state: LabState, label: str) -> None:
    """Fill f.sites / f.nodes from its target, as its kind takes it."""
    sites = {s.name for s in state.sites}
    nodes = {n.name: n for n in state.nodes}
    names = ", ".join(sorted(sites))
    if f.kind in ("kill", "slow"):
        if f.target in sites:
            f.sites, f.nodes = (f.target,), tuple(n.name for n in state.nodes_of(f.target))
        elif f.target in nodes:
            f.sites, f.nodes = (nodes[f.target].site,), (f.target,)
        else:
            raise BadInput(f"{label}: target {f.target!r} is no site or node of this lab (sites: {names})")
        return
    if f.kind == "cut" and f.target in sites:
        f.sites = (f.target,)
        return
    pair = next(((a, b) for i, ch in enumerate(f.target) if ch == "-"
                 for a, b in [(f.target[:i], f.target[i + 1:])] if a in sites and b in sites), None)
    if pair is None or pair[0] == pair[1]:
        takes = "a link A-B or a site" if f.kind == "cut" else "a link A-B"
        raise BadInput(f"{label}: target {f.target!r} is not {takes} of this lab (sites: {names})")
    f.sites = pair


# --- conflicts -----------------------------------------------------------------------------------

def _resources(f: Fault, state: LabState) -> list[str]:
    """What a fault holds while it lasts: two faults holding one resource at once conflict."""
    def pair(a: str, b: str) -> str:
        return "-".join(sorted((a, b)))

    if f.kind in ("cut", "flap"):
        links = [pair(*f.sites)] if len(f.sites) == 2 else \
            [pair(f.sites[0], s.name) for s in state.sites if s.name != f.sites[0]]
        return [f"link {x} (cut/flap)" for x in links]
    if f.kind in ("degrade", "loss"):
        return [f"link {pair(*f.sites)} ({f.kind})"]
    return [f"node {n} ({f.kind})" for n in f.nodes]


def _span(f: Fault) -> float:
    if f.kind != "kill":
        return f.for_s
    return f.grace_s + (f.restart_after_s + KILL_SPAN_S if f.restart_after_s is not None else 0.0)


def _check_conflicts(faults: list[Fault], jitter_s: float, state: LabState) -> None:
    """Two faults that may hold one link or node at once (jitter widens each by jitter_s both ways)
    are refused: undoing one would undo the other's change too."""
    held: dict[str, list[Fault]] = {}
    for f in faults:
        for res in _resources(f, state):
            for g in held.get(res, []):
                if f.at_s - jitter_s < g.at_s + _span(g) + jitter_s and g.at_s - jitter_s < f.at_s + _span(f) + jitter_s:
                    near = f" within the jitter of {fmt_s(jitter_s)}" if jitter_s else ""
                    raise BadInput(f"fault {f.index} ({f.describe()} at {fmt_s(f.at_s)}) overlaps fault {g.index} "
                                   f"({g.describe()} at {fmt_s(g.at_s)}){near} on {res}")
            held.setdefault(res, []).append(f)


# --- schedule ------------------------------------------------------------------------------------

def plan(scenario: Scenario, seed: int | None = None) -> Schedule:
    """Each fault's due time: `at` moved by U[-jitter, +jitter] from random.Random(seed) (no earlier
    than the start), in scenario order; then sorted by due time. No seed: one is drawn (and printed)."""
    if seed is None:
        seed = secrets.randbelow(2**31)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise BadInput(f"--seed: must be an integer >= 0, got {seed!r}")
    rng = random.Random(seed)
    items = []
    for f in scenario.faults:
        shift = rng.uniform(-scenario.jitter_s, scenario.jitter_s) if scenario.jitter_s else 0.0
        items.append(Planned(fault=f, at_s=max(0.0, f.at_s + shift)))
    items.sort(key=lambda p: (p.at_s, p.fault.index))
    return Schedule(seed=seed, jitter_s=scenario.jitter_s, items=items)
