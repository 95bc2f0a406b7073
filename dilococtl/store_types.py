"""The store's records as typed rows: runs, their sites and nodes, launches, events, tunes.

dilococtl/store.py reads and writes them; views and commands use these types. Metric records
(rounds, steps) are trainer.records' RoundRecord and StepRecord, shared with the trainer.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dilococtl.spec import spec_from_json
from dilococtl.spec_types import RunSpec
from dilococtl.states import RunState, SiteState
from trainer.records import RoundRecord


@dataclass(kw_only=True, slots=True)
class Run:
    id: str  # short, sortable, unique: "YYYYmmdd-HHMMSS-xxxx" (UTC)
    name: str  # run.name from the spec
    spec_path: str  # the file it was launched from
    spec_json: str  # the spec as launched (see `spec()`)
    state: RunState
    created: float
    updated: float
    finished: float | None  # when it last entered an ended state
    exit_reason: str | None  # why it ended (or why it is preempted)
    lighthouse: dict[str, Any]  # where the Lighthouse runs: url, host, pid... (launch decides)

    def spec(self) -> RunSpec:
        """The spec the run was launched with (not re-read from spec_path)."""
        return spec_from_json(self.spec_json)

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Run:
        """A run from its `runs` row (as `db.rows` returns it)."""
        r = dict(row)
        r["lighthouse"] = json.loads(r.pop("lighthouse_json") or "{}")
        r["state"] = RunState(r["state"])
        return cls(**r)


@dataclass(kw_only=True, slots=True)
class Site:
    run_id: str
    name: str
    idx: int  # site index: the trainer's run.site_index
    state: SiteState
    hosts: list[str]
    nproc: int  # processes per node


@dataclass(kw_only=True, slots=True)
class Node:
    run_id: str
    site: str
    host: str
    rank: int  # node rank inside its site (torchrun --node-rank)
    pid: int | None  # of the launched process group on that host
    log_path: str | None  # its log file on that host
    run_dir: str | None  # RUN_DIR on that host
    state: SiteState


@dataclass(kw_only=True, slots=True)
class Launch:
    id: int
    run_id: str
    attempt: int  # 1 for the first launch of a site, +1 per relaunch
    site: str
    started: float
    reason: str  # "launch", "resume", ...
    ok: bool
    message: str


@dataclass(kw_only=True, slots=True)
class Event:
    id: int  # increasing: poll with events(after_id=...)
    run_id: str
    site: str  # "" for run-wide events of the control plane
    event: str  # trainer.records.EVENT_KINDS, or a control-plane event
    message: str
    detail: dict[str, Any]
    round: int | None
    t: float

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Event:
        """An event from its `events` row (as `db.rows` returns it)."""
        r = dict(row)
        r["detail"] = json.loads(r.pop("detail_json") or "{}")
        r["message"] = r["message"] or ""
        return cls(**r)


@dataclass(kw_only=True, slots=True)
class Tune:
    id: int
    created: float
    spec_path: str
    links: Any  # measured links (JSON as given to add_tune)
    step_s: float
    payload_bytes: int
    h: int  # the chosen H
    budget: float  # allowed sync/compute fraction
    prediction: dict[str, Any]


def new_run_id(now: float | None = None) -> str:
    """UTC timestamp + 4 random hex digits: sorts by creation time, unique in practice."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime(now if now is not None else time.time())) \
        + "-" + secrets.token_hex(2)


def round_from_row(row: Mapping[str, Any]) -> RoundRecord:
    """A round record from its `rounds` row."""
    r = {k: v for k, v in row.items() if k != "run_id"}
    r["committed"] = bool(r["committed"])
    r["exchange_bytes"] = _int_list(r.get("exchange_bytes"))
    return RoundRecord(**r)


def _int_list(text: Any) -> list[int] | None:
    """A stored JSON list of byte counts; None for NULL or anything else a record could have held."""
    try:
        v = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        return None
    return v if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v) else None


def node_from_row(row: Mapping[str, Any]) -> Node:
    """A node from its `nodes` row."""
    return Node(**{**row, "state": SiteState(row["state"])})


def site_from_row(row: Mapping[str, Any]) -> Site:
    """A site from its `sites` row."""
    r = dict(row)
    r["hosts"] = json.loads(r.pop("hosts_json"))
    r["state"] = SiteState(r["state"])
    return Site(**r)
