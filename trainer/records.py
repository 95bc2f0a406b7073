"""The metrics contract between the trainer (writer) and the control plane (reader). No torch.

Every site's local rank 0 appends one JSON object per line to RUN_DIR/SITE/metrics.jsonl.
Each line has "kind" ("step", "round" or "event"), "site", "t" (unix seconds) and the fields of
its record type below. Readers ignore unknown fields, so fields may be added but never renamed.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

METRICS_FILE = "metrics.jsonl"  # per site, under RUN_DIR/SITE/

EVENT_KINDS = (
    "start",  # the site's trainer started (detail: config summary, params, resumed_from; flops_per_token,
    # device_name, peak_flops: the site's devices' peak FLOP/s, None where unknown, for MFU)
    "checkpoint",  # a checkpoint became complete (detail: round, path, seconds)
    "checkpoint_skipped",  # a corrupt/truncated checkpoint was passed over (detail: path, why)
    "heal",  # this site loaded the global state from a live peer (detail: round)
    "quorum",  # the set of participating sites changed (detail: k_active, replicas)
    "h_changed",  # the sync interval changed (detail: old, new, why)
    "preempted",  # SIGTERM: stopped at a safe point (detail: round, checkpoint)
    "stopped",  # the run ended normally (detail: rounds, val_ppl)
    "ended_behind",  # the other sites committed the run's last round without this straggler and left; it
    # stopped after its own last round, without a final model (detail: round, step)
    "error",  # the trainer failed (detail: message)
    "resume",  # written by the control plane when it relaunches a site
    "rejected",  # a site's contribution was dropped or clipped, or a round's average refused (detail:
    # site_rejected, reason; trainer/outer/guard.py, the outer service's push bound)
    "diverging",  # validation ppl rose train.diverge_evals evaluations in a row, or is non-finite
    # (detail: best_round, checkpoint_round)
    "coordinator_unreachable",  # a quorum waits on a Lighthouse that does not answer (detail: since, why)
    "coordinator_back",  # it answers again (detail: since, seconds)
    "coordinator_restart",  # written by the control plane when it restarted a dead coordinator (dilococtl.supervise)
)
PROBLEM_EVENTS = ("error", "rejected", "diverging", "checkpoint_skipped", "coordinator_unreachable",
                  "coordinator_restart", "ended_behind")  # what status lists under the table


@dataclass(kw_only=True, slots=True)
class StepRecord:
    step: int  # global inner step count of this site (monotonic across restarts)
    round: int  # outer round this step belongs to
    loss: float  # training loss of the step
    lr: float  # inner learning rate used
    step_s: float  # wall seconds of the step
    tokens_per_s: float  # tokens processed per second by the whole site
    kind: str = "step"
    site: str = ""
    t: float = field(default_factory=time.time)


@dataclass(kw_only=True, slots=True)
class RoundRecord:
    round: int  # outer round just finished (1-based count of committed + failed rounds)
    step: int  # inner steps done by this site when the round ended
    h: int  # inner steps in this round
    compute_s: float  # wall seconds of the H inner steps
    sync_s: float  # wall seconds of the outer exchange and update
    bytes_sent: int  # payload bytes this site put on the WAN for the round
    bytes_recv: int  # payload bytes this site received
    k_active: int  # sites that took part in the round's average
    k_nominal: int  # sites the run was planned with
    outer_lr: float  # effective outer learning rate (after elastic scaling)
    committed: bool  # whether the outer update was applied
    staleness: int = 0  # rounds between the parameters the delta was computed on and its application
    train_loss: float | None = None  # mean inner loss of the round
    val_loss: float | None = None  # validation loss after the outer step (None: not evaluated)
    val_ppl: float | None = None  # exp(val_loss)
    tokens: int = 0  # tokens this site has trained on so far
    # the exchange's parts as tune-h models them (its breakdown), seconds; None where the mode has no
    # such part (async, ddp). In overlap mode they are the background exchange's, not the wait in sync_s.
    exchange_t: float | None = None  # unix seconds this site entered the exchange (its quorum request)
    quorum_s: float | None = None  # the quorum RPC to the Lighthouse (and any heal it started)
    weight_s: float | None = None  # the all-gather of every site's weight, norm and timings
    payload_s: float | None = None  # the compressed average of the pseudo-gradients
    exchange_bytes: list[int] | None = None  # diloco.fragments: bytes this site sent in each of the round's
    # exchanges, in order (None: one exchange, bytes_sent)
    kind: str = "round"
    site: str = ""
    t: float = field(default_factory=time.time)

    @property
    def efficiency(self) -> float:
        total = self.compute_s + self.sync_s
        return self.compute_s / total if total > 0 else 0.0


@dataclass(kw_only=True, slots=True)
class EventRecord:
    event: str  # one of EVENT_KINDS
    message: str = ""  # one line for humans
    detail: dict[str, Any] = field(default_factory=dict)  # machine-readable extras
    round: int | None = None
    kind: str = "event"
    site: str = ""
    t: float = field(default_factory=time.time)


RECORD_TYPES = {"step": StepRecord, "round": RoundRecord, "event": EventRecord}


def to_line(rec: StepRecord | RoundRecord | EventRecord) -> str:
    """One JSON line (with trailing newline) for a record."""
    return json.dumps(dataclasses.asdict(rec), separators=(",", ":"), allow_nan=False) + "\n"


def parse_line(line: str) -> StepRecord | RoundRecord | EventRecord | None:
    """Parse one metrics line; None for a blank, partial or foreign line."""
    try:
        obj = json.loads(line)
        cls = RECORD_TYPES[obj["kind"]]
    except (ValueError, KeyError, TypeError):
        return None
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        return cls(**{k: v for k, v in obj.items() if k in names})
    except TypeError:
        return None


class MetricsWriter:
    """Appends records to a metrics file, flushing each line so readers see it at once."""

    def __init__(self, path, site: str):
        from pathlib import Path

        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.site = site
        self._f = open(self.path, "a", buffering=1)
        self._lock = threading.Lock()  # the checkpoint thread writes events too

    def write(self, rec: StepRecord | RoundRecord | EventRecord) -> None:
        rec.site = self.site
        line = to_line(rec)
        with self._lock:
            self._f.write(line)
            self._f.flush()

    def event(self, event: str, message: str = "", round: int | None = None, **detail: Any) -> None:
        self.write(EventRecord(event=event, message=message, round=round, detail=detail))

    def close(self) -> None:
        self._f.close()
