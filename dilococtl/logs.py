"""What `dilococtl logs` shows: a run's rounds and events, and its trainer logs, merged by time.

Three sources, one timeline:
- round records (loss, validation perplexity, sync seconds, K) and events, from the store (the
  collector reads them from each site's metrics.jsonl), each with the time it was written;
- the nodes' trainer logs (torchrun's output), read by offset from every node;
- with `lighthouse`, the Lighthouse's (or the async outer service's) log, and its TLS relay's.

Library chatter (torchft's per-step INFO lines, HTTP access lines of its checkpoint server,
torch's launcher banners, the flight-recorder warning of CPU builds) stays in the files but is
marked `noise` and hidden unless asked for. A log line carries the time of the newest timestamped
line before it in its file (torchft stamps its lines; a traceback does not), so the lines of every
site fall into place beside the records.
"""

from __future__ import annotations

import datetime as dt
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from dilococtl.errors import BadInput, DilocoError

READ_CHUNK = 4 << 20  # NodeConn.read_from returns at most about this much per call

# torchrun's per-process prefix: "[default0]:" (--tee / redirects) or "[rank0]:"
_RANK_PREFIX = re.compile(r"^\[(?:default|rank)(\d+)\]:")
# torchft (Rust): "2026-12-01T20:42:16.869 [INFO] [torchft::manager] - ..."
_TORCHFT = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)Z?\s+\[(TRACE|DEBUG|INFO|WARN|ERROR)\]\s+\[[\w:]+\]")
# Python logging with asctime: "2026-12-01 20:42:16,869 ..." (torch and torchft's Python side)
_PY_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)(?:[.,](\d+))?")
# glog-style lines of torch's C++ and launcher: "W1201 20:42:05.123000 4242 torch/distributed/run.py:..."
_GLOG = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+\s")
_NOISE = (
    re.compile(r"Unable to reset NCCL flight recorder"),  # torchft on a torch without NCCL (CPU)
    re.compile(r"^\S+ - - \[[^\]]+\] \"(?:GET|POST|PUT|HEAD|DELETE) "),  # checkpoint server access log
    re.compile(r"^\*{20,}$"),  # torchrun's OMP_NUM_THREADS banner
    re.compile(r"Setting OMP_NUM_THREADS environment variable"),
    re.compile(r"^(?:lighthouse|outer service) listening on "),
)
# a Python warning raised inside an installed library; its next, indented line is the source line
_LIB_WARNING = re.compile(r"^\S*(?:site|dist)-packages/\S+:\d+: \w*Warning: ")
_SINCE = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|m|h|d)$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclass(kw_only=True, slots=True)
class LogLine:
    """One line of the merged view."""

    t: float  # unix seconds: when it was written (log lines: their file's newest stamp so far)
    site: str  # site name; "run" for the control plane's run-wide events; "lighthouse"
    kind: str  # "round", "event" or "log"
    text: str  # the line without time and site
    node: int | None = None  # log lines: node rank inside the site
    noise: bool = False  # library chatter: shown with --all
    record: dict[str, Any] | None = None  # rounds and events: the record's fields (--json)
    seq: int = 0  # order of arrival, for equal times

    @property
    def source(self) -> str:
        return self.site if self.node is None else f"{self.site}/node{self.node}"

    def render(self, width: int = 0) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(self.t))
        return f"{stamp} {self.source:<{width}} {self.text}"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"t": round(self.t, 3), "site": self.site, "kind": self.kind, "text": self.text}
        if self.node is not None:
            out["node"] = self.node
        if self.noise:
            out["noise"] = True
        if self.record is not None:
            out["record"] = self.record
        return out


# --- records ------------------------------------------------------------------------------------

def round_text(r: Any) -> str:
    """`round 3  step 60  loss 2.534  val ppl 12.52  sync 0.12s  (quorum 0.010 weight 0.020 payload 0.080)  K 2/2`
    (+ staleness, not committed)."""
    parts = [f"round {r.round}", f"step {r.step}"]
    if r.train_loss is not None:
        parts.append(f"loss {r.train_loss:.4f}")
    if r.val_ppl is not None:
        parts.append(f"val ppl {r.val_ppl:.3f}")
    parts.append(f"sync {r.sync_s:.2f}s")
    split = [f"{name} {v:.3f}" for name, v in (("quorum", r.quorum_s), ("weight", r.weight_s),
                                                ("payload", r.payload_s)) if v is not None]
    if split:
        parts.append(f"({' '.join(split)})")
    parts.append(f"K {r.k_active}/{r.k_nominal}")
    if r.staleness:
        parts.append(f"staleness {r.staleness}")
    if not r.committed:
        parts.append("NOT COMMITTED")
    return "  ".join(parts)


def round_line(r: Any) -> LogLine:
    fields = {k: getattr(r, k) for k in ("round", "step", "h", "train_loss", "val_loss", "val_ppl", "compute_s",
                                          "sync_s", "quorum_s", "weight_s", "payload_s", "k_active", "k_nominal",
                                          "staleness", "committed", "tokens", "bytes_sent", "bytes_recv", "outer_lr")}
    return LogLine(t=r.t, site=r.site, kind="round", text=round_text(r), record=fields)


def event_line(ev: Any) -> LogLine:
    text = ev.event + (f" r{ev.round}" if ev.round is not None else "") + (f"  {ev.message}" if ev.message else "")
    return LogLine(t=ev.t, site=ev.site or "run", kind="event", text=text,
                   record={"event": ev.event, "round": ev.round, "message": ev.message, "detail": ev.detail})


# --- log files ----------------------------------------------------------------------------------

def _stamp(s: str) -> float | None:
    """A log timestamp (no zone: the node's local time, as the loggers write it) as unix seconds."""
    try:
        return dt.datetime.fromisoformat(s.replace(",", ".")).timestamp()
    except ValueError:
        return None


def classify(raw: str) -> tuple[str, int | None, float | None, bool]:
    """(text without torchrun's prefix, local rank, timestamp, noise) of one log line."""
    rank = None
    m = _RANK_PREFIX.match(raw)
    if m:
        rank, raw = int(m.group(1)), raw[m.end():]
    text = raw.rstrip()
    t = None
    m = _TORCHFT.match(text)
    if m:
        t = _stamp(m.group(1))
        return text, rank, t, m.group(2) in ("TRACE", "DEBUG", "INFO")
    m = _PY_STAMP.match(text)
    if m:
        t = _stamp(m.group(1) + (f".{m.group(2)}" if m.group(2) else ""))
    m = _GLOG.match(text)
    if m and m.group(1) in ("I", "W"):
        return text, rank, t, True
    return text, rank, t, not text.strip() or any(p.search(text) for p in _NOISE)


# the trainer's own last word (trainer/entry.py prints "error: ..." before exiting non-zero), else
# the first exception line of a traceback ("IndexError: ...", "torch.distributed.DistError: ...")
_TRAINER_ERROR = re.compile(r"^error: \S")
_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception): \S")
ERROR_LINE_MAX = 300  # characters of a node's error line carried into a run's "ended because"


def first_error(text: str) -> str | None:
    """The first error line of a node's log (torchrun's rank prefix removed), or None: what a run
    that failed before its first round says in `launch`, `status` and "ended because"."""
    lines = [classify(raw)[0].strip() for raw in text.splitlines()]
    for pattern in (_TRAINER_ERROR, _EXCEPTION):
        hit = next((ln for ln in lines if pattern.match(ln)), None)
        if hit is not None:
            return hit[:ERROR_LINE_MAX]
    return None


@dataclass(kw_only=True, slots=True)
class _File:
    """A log file being followed: where it was read up to, and the time its last line carried."""

    site: str
    node: int | None
    host: str
    path: str
    offset: int = 0
    partial: bytes = b""
    last_t: float | None = None
    pending: list[LogLine] = field(default_factory=list)  # lines before the file's first stamp
    in_warning: bool = False  # the previous line was a library's warning (its source line follows)


def parse_chunk(f: _File, data: bytes, *, final: bool = False) -> list[LogLine]:
    """The complete lines of `data` appended to `f` (the rest waits for the next chunk)."""
    lines = (f.partial + data).split(b"\n")
    f.partial = b"" if final else lines.pop()
    out: list[LogLine] = []
    for raw in lines:
        if not raw and final:
            continue
        text, rank, t, noise = classify(raw.decode("utf-8", "replace"))
        if _LIB_WARNING.match(text):
            noise, f.in_warning = True, True
        elif f.in_warning and text.startswith("  "):
            noise, f.in_warning = True, False
        else:
            f.in_warning = False
        if rank:
            text = f"[rank {rank}] {text}"
        if t is not None:
            f.last_t = t
            for p in f.pending:  # startup lines before any stamp: placed at the first one
                p.t = t
            out += f.pending
            f.pending = []
        line = LogLine(t=f.last_t or 0.0, site=f.site, node=f.node, kind="log", text=text, noise=noise)
        if f.last_t is None:
            f.pending.append(line)
        else:
            out.append(line)
    return out


# --- filters ------------------------------------------------------------------------------------

def parse_since(value: str, now: float | None = None) -> float:
    """`--since`: a duration back from now (90s, 10m, 2h, 1d) or a local time (2026-12-01T20:40, 20:40)."""
    now = time.time() if now is None else now
    v = value.strip()
    m = _SINCE.match(v)
    if m:
        return now - float(m.group(1)) * _UNIT_S[m.group(2)]
    try:
        if re.fullmatch(r"\d\d?:\d\d(:\d\d)?", v):  # a time of today
            day = dt.datetime.fromtimestamp(now).date()
            return dt.datetime.combine(day, dt.time.fromisoformat(v.zfill(5) if len(v) == 4 else v)).timestamp()
        return dt.datetime.fromisoformat(v).timestamp()
    except ValueError:
        raise BadInput(f"--since {value!r}: expected a duration (90s, 10m, 2h, 1d) or a time "
                       "(20:40, 2026-12-01T20:40)") from None


def compile_grep(pattern: str | None) -> re.Pattern | None:
    if pattern is None:
        return None
    try:
        return re.compile(pattern, re.IGNORECASE)
    except re.error as e:
        raise BadInput(f"--grep {pattern!r}: not a regular expression ({e})") from None


@dataclass(kw_only=True, slots=True)
class Filter:
    """What the operator asked to see."""

    site: str | None = None  # only this site (and the run-wide events)
    since: float | None = None  # unix seconds
    grep: re.Pattern | None = None  # on the rendered line (source and text)
    all: bool = False  # library chatter too
    logs: bool = True  # log lines at all (False: records only)

    def keep(self, line: LogLine) -> bool:
        if line.noise and not self.all:
            return False
        if line.kind == "log" and not self.logs:
            return False
        if self.site is not None and line.site not in (self.site, "run"):
            return False
        if self.since is not None and line.t < self.since:
            return False
        return self.grep is None or bool(self.grep.search(f"{line.source} {line.text}"))


def select(lines: Iterable[LogLine], flt: Filter, tail: int | None = None) -> list[LogLine]:
    """The lines `flt` keeps, oldest first; the last `tail` of them when given."""
    kept = sorted((ln for ln in lines if flt.keep(ln)), key=lambda ln: (ln.t, ln.seq))
    if tail is not None:
        kept = kept[-tail:] if tail > 0 else []
    return kept


# --- reading a run ------------------------------------------------------------------------------

class RunLogs:
    """Reads a run's records (from the store) and log files (from its nodes) a piece at a time.

    `poll()` returns what is new since the previous call, so one object serves both a single
    print and `--follow`. Log files are read by offset; a node that cannot be read is reported in
    `errors` (host -> message) and tried again at the next poll.
    """

    def __init__(self, run: Any, store: Any, *, lighthouse: bool = False) -> None:
        self.run = run
        self.store = store
        # a Slurm site's one node row is its login node; its job's files are listed by the site backend
        from dilococtl.site_backend import job_log_paths

        jobs = job_log_paths(run, store)
        job_sites = {site for site, *_ in jobs}
        self.files = [_File(site=n.site, node=n.rank, host=n.host, path=n.log_path)
                      for n in store.nodes(run.id) if n.log_path and n.site not in job_sites]
        self.files += [_File(site=site, node=node, host=host, path=path) for site, node, host, path in jobs]
        lh = run.lighthouse or {}
        if lighthouse:  # and its TLS relay's: it says when the Lighthouse behind it did not answer
            self.files += [_File(site=site, node=None, host=lh["host"], path=lh[key])
                           for site, key in (("lighthouse", "log_path"), ("lighthouse-relay", "relay_log_path"))
                           if lh.get(key)]
        self.errors: dict[str, str] = {}
        self._seen_rounds: set[tuple[str, int, float]] = set()
        self._last_event = 0
        self._seq = 0
        self._polls = 0

    def sites(self) -> list[str]:
        return [s.name for s in self.store.sites(self.run.id)]

    def poll(self, pool: Any | None, *, final: bool = False) -> list[LogLine]:
        """New lines since the last poll. `pool` None: records only. `final`: flush partial lines."""
        out = self._records()
        if pool is not None:
            out += self._read_files(pool, final)
        for ln in out:
            self._seq += 1
            ln.seq = self._seq
        self._polls += 1
        return out

    def _records(self) -> list[LogLine]:
        out = []
        for r in self.store.rounds(self.run.id):
            key = (r.site, r.round, r.t)
            if key not in self._seen_rounds:
                self._seen_rounds.add(key)
                out.append(round_line(r))
        for ev in self.store.events(self.run.id, after_id=self._last_event):
            self._last_event = max(self._last_event, ev.id)
            out.append(event_line(ev))
        return out

    def _read_files(self, pool: Any, final: bool) -> list[LogLine]:
        out: list[LogLine] = []
        for f in self.files:
            try:
                node = pool.get(f.host)
                while True:
                    data = node.read_from(f.path, f.offset)
                    f.offset += len(data)
                    out += parse_chunk(f, data)
                    if len(data) < READ_CHUNK:
                        break
                self.errors.pop(f.host, None)
            except DilocoError as e:
                self.errors[f.host] = str(e)
            if final:
                out += parse_chunk(f, b"", final=True)
            if f.pending:  # no stamp in the file yet: at the run's start, later ones when read
                for p in f.pending:
                    p.t = self.run.created if self._polls == 0 else time.time()
                out += f.pending
                f.pending = []
        return out
