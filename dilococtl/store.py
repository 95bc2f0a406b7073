"""The control plane's records: the typed repository over the store's SQLite file.

The connection (WAL, busy timeout, migration on open) is dilococtl/db.py; the schema is the
numbered migrations of dilococtl/migrations.py; the states and their allowed moves are
dilococtl/states.py; the typed rows are dilococtl/store_types.py. Tables: runs, sites, nodes,
launches, rounds, steps, events, offsets, tunes. Times are unix seconds; structured fields are JSON
text columns. Nothing secret is ever stored: specs hold key *paths*, never key material or passwords.

Every write is one IMMEDIATE transaction: a run appears with all its sites and nodes or not at all,
and `ingest` stores metrics together with the file offset they were read up to, so a collector
that dies between the two can neither lose nor double-count lines.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from sqlite_utils import Database

from dilococtl import db as db_mod
from dilococtl.db import write_transaction
from dilococtl.errors import BadInput, store_error
from dilococtl.spec import spec_to_json
from dilococtl.spec_checks import validate_spec
from dilococtl.spec_sites import nproc_per_node, site_run_dir
from dilococtl.spec_types import RunSpec
from dilococtl.states import (
    ACTIVE_RUN_STATES,
    ENDED_RUN_STATES,
    RunState,
    SiteState,
    check_run_move,
    check_site_move,
    run_state,
    site_state,
)
from dilococtl.store_types import (
    Event,
    Launch,
    Node,
    Run,
    Site,
    Tune,
    new_run_id,
    node_from_row,
    round_from_row,
    site_from_row,
)
from trainer.records import EventRecord, RoundRecord, StepRecord, parse_line

__all__ = ["Event", "Launch", "Node", "Run", "Site", "Store", "Tune", "new_run_id"]  # the types: store_types

_ROUND_COLS = tuple(f.name for f in dataclasses.fields(RoundRecord) if f.name not in ("kind", "site"))
_STEP_COLS = tuple(f.name for f in dataclasses.fields(StepRecord) if f.name not in ("kind", "site"))


class Store:
    """The records, behind a typed API. Open with `Store.open()`; usable as a context manager."""

    def __init__(self, db: Database, path: Path):
        self.db = db
        self.path = path

    @classmethod
    def open(cls, path: str | Path | None = None) -> Store:
        """Open (creating and migrating) the store; default: dilococtl.paths.db_path()."""
        if path is None:
            from dilococtl.paths import db_path

            try:
                path = db_path()
            except OSError as e:  # DILOCOCTL_HOME is a file, or cannot be created
                raise store_error(e.filename or "DILOCOCTL_HOME", e) from e
        return cls(db_mod.connect(path), Path(path))

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.close()
        if isinstance(exc, sqlite3.Error):  # locked, damaged or unwritable in the middle of a command
            raise store_error(self.path, exc, db_mod.BUSY_TIMEOUT_S) from exc

    def _q(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        return db_mod.rows(self.db, sql, params)

    # --- runs ---------------------------------------------------------------------------------

    def create_run(self, spec: RunSpec, *, run_id: str | None = None, state: str = RunState.LAUNCHING,
                   run_dirs: Mapping[str, str] | None = None, lighthouse: dict[str, Any] | None = None) -> Run:
        """Record a new run with its sites and nodes (all pending), in one transaction.

        The spec is validated again first, so a bad spec writes nothing. `run_dirs` maps a site
        name to its RUN_DIR on the nodes (default: `spec.site_run_dir`).
        """
        validate_spec(spec)
        state = run_state(state)
        now = time.time()
        with write_transaction(self.db):
            rid = run_id or self._fresh_id(now)
            try:
                self.db.conn.execute(
                    "INSERT INTO runs (id, name, spec_path, spec_json, state, created, updated, lighthouse_json)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (rid, spec.run.name, spec.path, spec_to_json(spec), state, now, now,
                     json.dumps(lighthouse or {})))
                for i, site in enumerate(spec.sites):
                    self.db.conn.execute(
                        "INSERT INTO sites (run_id, name, idx, state, hosts_json, nproc) VALUES (?, ?, ?, ?, ?, ?)",
                        (rid, site.name, i, SiteState.PENDING, json.dumps(site.hosts), nproc_per_node(site)))
                    run_dir = (run_dirs or {}).get(site.name) or site_run_dir(spec, i, rid)
                    for rank, host in enumerate(site.hosts):
                        self.db.conn.execute(
                            "INSERT INTO nodes (run_id, site, host, rank, run_dir, state) VALUES (?, ?, ?, ?, ?, ?)",
                            (rid, site.name, host, rank, run_dir, SiteState.PENDING))
            except sqlite3.IntegrityError as e:
                raise BadInput(f"cannot record run {rid} of {spec.path}: {e}") from None
        return self.get_run(rid)

    def _fresh_id(self, now: float) -> str:
        while True:
            rid = new_run_id(now)
            if not self.db.conn.execute("SELECT 1 FROM runs WHERE id = ?", (rid,)).fetchone():
                return rid

    def get_run(self, id_or_name: str) -> Run:
        """A run by exact id, else the newest run with that name, else by unique id prefix."""
        rows = self._q("SELECT * FROM runs WHERE id = ?", (id_or_name,)) \
            or self._q("SELECT * FROM runs WHERE name = ? ORDER BY created DESC, id DESC LIMIT 1", (id_or_name,))
        if not rows and id_or_name:
            rows = self._q("SELECT * FROM runs WHERE substr(id, 1, ?) = ?", (len(id_or_name), id_or_name))
            if len(rows) > 1:
                raise BadInput(f"run id prefix {id_or_name!r} is ambiguous: "
                               f"{', '.join(sorted(r['id'] for r in rows))}")
        if not rows:
            raise BadInput(f"no run with id or name {id_or_name!r} (see `dilococtl runs`)")
        return Run.from_row(rows[0])

    def latest_run(self) -> Run | None:
        """The newest run, or None when there is none."""
        rows = self._q("SELECT * FROM runs ORDER BY created DESC, id DESC LIMIT 1")
        return Run.from_row(rows[0]) if rows else None

    def active_run(self, name: str | None = None) -> Run | None:
        """The newest run named `name` (any name: None) that still holds it (launching, running or preempted)."""
        where, params = f"state IN ({','.join('?' * len(ACTIVE_RUN_STATES))})", list(ACTIVE_RUN_STATES)
        if name is not None:
            where, params = "name = ? AND " + where, [name, *params]
        rows = self._q(f"SELECT * FROM runs WHERE {where} ORDER BY created DESC, id DESC LIMIT 1", params)
        return Run.from_row(rows[0]) if rows else None

    def list_runs(self, *, state: str | None = None, limit: int | None = None) -> list[Run]:
        """Runs, newest first."""
        sql, params = "SELECT * FROM runs", []
        if state:
            sql, params = sql + " WHERE state = ?", [state]
        sql += " ORDER BY created DESC, id DESC"
        if limit:
            sql, params = sql + " LIMIT ?", [*params, limit]
        return [Run.from_row(r) for r in self._q(sql, params)]

    def set_run_state(self, run_id: str, state: str, reason: str | None = None) -> Run:
        """Move a run to `state` (see dilococtl.states.RUN_MOVES); an impossible move raises BadInput."""
        run_state(state)
        with write_transaction(self.db):
            run = self.get_run(run_id)
            state = check_run_move(f"run {run.id}", run.state, state)
            now = time.time()
            if state in ENDED_RUN_STATES:
                finished, exit_reason = (run.finished if state == run.state else now), reason or run.exit_reason
            else:
                finished, exit_reason = None, None
            self.db.conn.execute("UPDATE runs SET state = ?, updated = ?, finished = ?, exit_reason = ? WHERE id = ?",
                                 (state, now, finished, exit_reason, run.id))
        return self.get_run(run.id)

    def set_lighthouse(self, run_id: str, info: Mapping[str, Any]) -> None:
        """Where the run's Lighthouse runs (url, host, pid, ...)."""
        with write_transaction(self.db):
            self._touch(run_id, "UPDATE runs SET lighthouse_json = ?, updated = ? WHERE id = ?",
                        (json.dumps(dict(info)), time.time(), run_id))

    def set_spec(self, run_id: str, spec: RunSpec) -> None:
        """Replace the spec a run is relaunched with (supervision moving its coordinator to another host)."""
        validate_spec(spec)
        with write_transaction(self.db):
            self._touch(run_id, "UPDATE runs SET spec_json = ?, updated = ? WHERE id = ?",
                        (spec_to_json(spec), time.time(), run_id))

    def delete_run(self, run_id: str) -> None:
        """Forget a run: its row and every row that names it, in one transaction (tunes are kept)."""
        with write_transaction(self.db):
            for table in ("offsets", "events", "steps", "rounds", "launches", "nodes", "sites"):
                self.db.conn.execute(f"DELETE FROM {table} WHERE run_id = ?", (run_id,))
            self._touch(run_id, "DELETE FROM runs WHERE id = ?", (run_id,))

    def _touch(self, run_id: str, sql: str, params: tuple) -> None:
        if self.db.conn.execute(sql, params).rowcount == 0:
            raise BadInput(f"no such run {run_id!r}")

    # --- sites and nodes ----------------------------------------------------------------------

    def sites(self, run_id: str) -> list[Site]:
        """The run's sites in index order."""
        return [site_from_row(r) for r in self._q("SELECT * FROM sites WHERE run_id = ? ORDER BY idx", (run_id,))]

    def set_site_state(self, run_id: str, site: str, state: str) -> None:
        """Move a site to `state` (see dilococtl.states.SITE_MOVES); an impossible move raises BadInput."""
        site_state(state)
        with write_transaction(self.db):
            row = self.db.conn.execute("SELECT state FROM sites WHERE run_id = ? AND name = ?",
                                       (run_id, site)).fetchone()
            if row is None:
                raise BadInput(f"run {run_id} has no site {site!r}")
            state = check_site_move(f"site {site} of run {run_id}", row[0], state)
            self.db.conn.execute("UPDATE sites SET state = ? WHERE run_id = ? AND name = ?", (state, run_id, site))

    def nodes(self, run_id: str, site: str | None = None) -> list[Node]:
        """The run's nodes, by site index then node rank."""
        sql = ("SELECT n.* FROM nodes n JOIN sites s ON s.run_id = n.run_id AND s.name = n.site"
               " WHERE n.run_id = ?")
        params: list[Any] = [run_id]
        if site is not None:
            sql, params = sql + " AND n.site = ?", [run_id, site]
        return [node_from_row(r) for r in self._q(sql + " ORDER BY s.idx, n.rank", params)]

    def set_node(self, run_id: str, site: str, host: str, *, state: str | None = None, pid: int | None = None,
                 log_path: str | None = None, run_dir: str | None = None) -> Node:
        """Update the given fields of one node (None: unchanged); the state moves as SITE_MOVES allows."""
        if state is not None:
            site_state(state)
        changes = {k: v for k, v in (("state", state), ("pid", pid), ("log_path", log_path),
                                     ("run_dir", run_dir)) if v is not None}
        with write_transaction(self.db):
            if state is not None:
                row = self.db.conn.execute("SELECT state FROM nodes WHERE run_id = ? AND site = ? AND host = ?",
                                           (run_id, site, host)).fetchone()
                if row is None:
                    raise BadInput(f"run {run_id} has no node {host!r} in site {site!r}")
                changes["state"] = check_site_move(f"node {host} of site {site} (run {run_id})", row[0], state)
            if changes:
                sets = ", ".join(f"{k} = ?" for k in changes)
                cur = self.db.conn.execute(f"UPDATE nodes SET {sets} WHERE run_id = ? AND site = ? AND host = ?",
                                           (*changes.values(), run_id, site, host))
                if cur.rowcount == 0:
                    raise BadInput(f"run {run_id} has no node {host!r} in site {site!r}")
            rows = self._q("SELECT * FROM nodes WHERE run_id = ? AND site = ? AND host = ?", (run_id, site, host))
        if not rows:
            raise BadInput(f"run {run_id} has no node {host!r} in site {site!r}")
        return node_from_row(rows[0])

    # --- launches and events ------------------------------------------------------------------

    def add_launch(self, run_id: str, site: str, *, reason: str = "launch", ok: bool = True, message: str = "",
                   attempt: int | None = None, started: float | None = None) -> Launch:
        """Record one (re)launch of a site; attempt defaults to the site's previous attempt + 1."""
        with write_transaction(self.db):
            if attempt is None:
                (prev,) = self.db.conn.execute("SELECT max(attempt) FROM launches WHERE run_id = ? AND site = ?",
                                               (run_id, site)).fetchone()
                attempt = (prev or 0) + 1
            try:
                cur = self.db.conn.execute(
                    "INSERT INTO launches (run_id, attempt, site, started, reason, ok, message)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (run_id, attempt, site, started if started is not None else time.time(), reason, int(ok), message))
            except sqlite3.IntegrityError:
                raise BadInput(f"no such run {run_id!r}") from None
            rid = cur.lastrowid
        return self.launches(run_id, _id=rid)[0]

    def launches(self, run_id: str, *, site: str | None = None, _id: int | None = None) -> list[Launch]:
        sql, params = "SELECT * FROM launches WHERE run_id = ?", [run_id]
        if site is not None:
            sql, params = sql + " AND site = ?", [*params, site]
        if _id is not None:
            sql, params = sql + " AND id = ?", [*params, _id]
        rows = self._q(sql + " ORDER BY id", params)
        return [Launch(**{**r, "ok": bool(r["ok"]), "message": r["message"] or "", "reason": r["reason"] or ""})
                for r in rows]

    def add_event(self, run_id: str, event: str, message: str = "", *, site: str = "",
                  detail: Mapping[str, Any] | None = None, round: int | None = None, t: float | None = None) -> bool:
        """Record an event (site "" = the run as a whole); False when the same event was already there."""
        if not event:
            raise BadInput("an event needs a name")
        with write_transaction(self.db):
            try:
                return self._insert_event(run_id, site, EventRecord(
                    event=event, message=message, detail=dict(detail or {}), round=round,
                    t=t if t is not None else time.time())) > 0
            except sqlite3.IntegrityError:
                raise BadInput(f"no such run {run_id!r}") from None

    def _insert_event(self, run_id: str, site: str, rec: EventRecord) -> int:
        return self.db.conn.execute(
            "INSERT OR IGNORE INTO events (run_id, site, event, message, detail_json, round, t)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (run_id, site, rec.event, rec.message, json.dumps(rec.detail, default=str), rec.round, rec.t)).rowcount

    def events(self, run_id: str, *, site: str | None = None, after_id: int = 0, kinds: Iterable[str] | None = None,
               limit: int | None = None) -> list[Event]:
        """Events in time order; `after_id` returns only newer rows (for polling), `limit` the newest."""
        sql, params = "SELECT * FROM events WHERE run_id = ? AND id > ?", [run_id, after_id]
        if site is not None:
            sql, params = sql + " AND site = ?", [*params, site]
        if kinds is not None:
            kinds = list(kinds)
            sql, params = sql + f" AND event IN ({','.join('?' * len(kinds))})", [*params, *kinds]
        if limit:  # the newest `limit`, still returned oldest first
            sql, params = f"SELECT * FROM ({sql} ORDER BY t DESC, id DESC LIMIT ?)", [*params, limit]
        sql += " ORDER BY t, id"
        return [Event.from_row(r) for r in self._q(sql, params)]

    # --- metrics ------------------------------------------------------------------------------

    def ingest(self, run_id: str, site: str, host: str, path: str, new_offset: int, lines: list[str]) -> int:
        """Store the records of `lines` read from `path` on `host`, and the offset read up to.

        Pass complete lines only and the byte offset just past the last one. Idempotent: steps
        and rounds are keyed by (site, step/round), so ingesting the same lines twice changes nothing,
        and a round or step redone after a restart replaces the old row; events are keyed by
        (site, t, event). Lines that are not records are skipped. Records are filed under `site`
        (the file's site), whatever their own "site" field says. Returns the rows inserted or changed.
        """
        changed = 0
        with write_transaction(self.db):
            if not self.db.conn.execute("SELECT 1 FROM runs WHERE id = ?", (run_id,)).fetchone():
                raise BadInput(f"no such run {run_id!r}")
            for line in lines:
                rec = parse_line(line)
                if isinstance(rec, RoundRecord):
                    changed += self._upsert("rounds", ("run_id", "site", "round"), _ROUND_COLS, run_id, site, rec)
                elif isinstance(rec, StepRecord):
                    changed += self._upsert("steps", ("run_id", "site", "step"), _STEP_COLS, run_id, site, rec)
                elif isinstance(rec, EventRecord):
                    changed += self._insert_event(run_id, site, rec)
            self.db.conn.execute(
                "INSERT INTO offsets (run_id, site, host, path, offset) VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT (run_id, site, host, path) DO UPDATE SET offset = excluded.offset",
                (run_id, site, host, path, int(new_offset)))
        return changed

    def _upsert(self, table: str, key: tuple[str, ...], cols: tuple[str, ...], run_id: str, site: str,
                rec: RoundRecord | StepRecord) -> int:
        values = [run_id, site] + [getattr(rec, c) for c in cols]
        values = [int(v) if isinstance(v, bool) else json.dumps(v) if isinstance(v, list | dict) else v
                  for v in values]
        names = ("run_id", "site", *cols)
        data_cols = [c for c in cols if c not in key]
        sql = (f"INSERT INTO {table} ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})"
               f" ON CONFLICT ({', '.join(key)}) DO UPDATE SET "
               + ", ".join(f"{c} = excluded.{c}" for c in data_cols)
               + " WHERE " + " OR ".join(f"{table}.{c} IS NOT excluded.{c}" for c in data_cols))
        return self.db.conn.execute(sql, values).rowcount

    def offset(self, run_id: str, site: str, host: str, path: str) -> int:
        """Byte offset of `path` on `host` that has been ingested (0: nothing yet)."""
        row = self.db.conn.execute("SELECT offset FROM offsets WHERE run_id = ? AND site = ? AND host = ? AND path = ?",
                                   (run_id, site, host, path)).fetchone()
        return int(row[0]) if row else 0

    def rounds(self, run_id: str, site: str | None = None, *, after: int = 0) -> list[RoundRecord]:
        """Round records by round, then site index; `after`: only the rounds past that one."""
        sql = ("SELECT r.* FROM rounds r LEFT JOIN sites s ON s.run_id = r.run_id AND s.name = r.site"
               " WHERE r.run_id = ? AND r.round > ?")
        params: list[Any] = [run_id, after]
        if site is not None:
            sql, params = sql + " AND r.site = ?", [*params, site]
        return [round_from_row(r) for r in self._q(sql + " ORDER BY r.round, s.idx, r.site", params)]

    def latest_rounds(self, run_id: str) -> dict[str, RoundRecord]:
        """Per site, its newest round record (sites without one are absent)."""
        rows = self._q("SELECT r.* FROM rounds r JOIN (SELECT site, max(round) AS m FROM rounds WHERE run_id = ?"
                       " GROUP BY site) x ON x.site = r.site AND x.m = r.round WHERE r.run_id = ?", (run_id, run_id))
        return {r["site"]: round_from_row(r) for r in rows}

    def steps(self, run_id: str, site: str | None = None, *, after_step: int = -1,
              limit: int | None = None) -> list[StepRecord]:
        """Step records by site then step; `limit` keeps the newest ones."""
        sql, params = "SELECT * FROM steps WHERE run_id = ? AND step > ?", [run_id, after_step]
        if site is not None:
            sql, params = sql + " AND site = ?", [*params, site]
        if limit:
            sql, params = f"SELECT * FROM ({sql} ORDER BY t DESC, step DESC LIMIT ?)", [*params, limit]
        rows = self._q(sql + " ORDER BY site, step", params)
        return [StepRecord(**{k: v for k, v in r.items() if k != "run_id"}) for r in rows]

    # --- tune-h -------------------------------------------------------------------------------

    def add_tune(self, *, spec_path: str, links: Any, step_s: float, payload_bytes: int, h: int, budget: float,
                 prediction: Mapping[str, Any], created: float | None = None) -> Tune:
        """Record one tune-h measurement and its choice of H."""
        with write_transaction(self.db):
            cur = self.db.conn.execute(
                "INSERT INTO tunes (created, spec_path, links_json, step_s, payload_bytes, h, budget, prediction_json)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (created if created is not None else time.time(), spec_path, json.dumps(links), step_s,
                 payload_bytes, h, budget, json.dumps(dict(prediction))))
            tid = cur.lastrowid
        return next(t for t in self.tunes() if t.id == tid)

    def tunes(self, *, spec_path: str | None = None) -> list[Tune]:
        """Tune-h results, newest first."""
        sql, params = "SELECT * FROM tunes", []
        if spec_path is not None:
            sql, params = sql + " WHERE spec_path = ?", [spec_path]
        out = []
        for r in self._q(sql + " ORDER BY created DESC, id DESC", params):
            r["links"] = json.loads(r.pop("links_json") or "null")
            r["prediction"] = json.loads(r.pop("prediction_json") or "{}")
            out.append(Tune(**r))
        return out

    # --- doctor --links ---------------------------------------------------------------------------

    def add_link_probe(self, *, spec_path: str, links: Any, created: float | None = None) -> int:
        """Record the links `doctor --links` measured (dilococtl.tune.Link dicts); returns the row id."""
        with write_transaction(self.db):
            cur = self.db.conn.execute("INSERT INTO link_probes (created, spec_path, links_json) VALUES (?, ?, ?)",
                                       (created if created is not None else time.time(), spec_path, json.dumps(links)))
            return int(cur.lastrowid)

    def link_probes(self, since: float = 0.0) -> list[dict[str, Any]]:
        """Link measurements of doctor --links and tune-h made after `since`, newest first:
        {"source": "doctor" | "tune-h", "id", "created", "links"}."""
        rows = [{"source": "doctor", "id": r["id"], "created": r["created"], "links": json.loads(r["links_json"])}
                for r in self._q("SELECT * FROM link_probes WHERE created > ?", [since])]
        rows += [{"source": "tune-h", "id": r["id"], "created": r["created"], "links": json.loads(r["links_json"] or "[]")}
                 for r in self._q("SELECT id, created, links_json FROM tunes WHERE created > ?", [since])]
        return sorted(rows, key=lambda r: r["created"], reverse=True)

    # --- scheduler jobs (Slurm sites, issue 37) --------------------------------------------------

    def add_job_node(self, run_id: str, site: str, login: str, *, run_dir: str, log_path: str) -> Node:
        """The one node row a scheduler site has: its login node (rank 0, no pid), through which its
        metrics, logs and checkpoints are read on the cluster's shared filesystem. Kept if it exists."""
        with write_transaction(self.db):
            self.db.conn.execute(
                "INSERT OR IGNORE INTO nodes (run_id, site, host, rank, run_dir, log_path, state)"
                " VALUES (?, ?, ?, 0, ?, ?, ?)", (run_id, site, login, run_dir, log_path, SiteState.PENDING))
        return next(n for n in self.nodes(run_id, site) if n.host == login)

    def set_site_job(self, run_id: str, site: str, *, job_id: str, login: str, run_dir: str,
                     scheduler: str = "slurm") -> dict[str, Any]:
        """Record a (re)submission of `site`'s job: its id replaces the previous one, `submits` counts up."""
        now = time.time()
        with write_transaction(self.db):
            self.db.conn.execute(
                "INSERT INTO site_jobs (run_id, site, scheduler, job_id, login, run_dir, detail, nodes, submits,"
                " submitted, updated) VALUES (?, ?, ?, ?, ?, ?, '', '', 1, ?, ?)"
                " ON CONFLICT (run_id, site) DO UPDATE SET job_id = excluded.job_id, login = excluded.login,"
                " run_dir = excluded.run_dir, detail = '', nodes = '', submits = submits + 1,"
                " submitted = excluded.submitted, updated = excluded.updated",
                (run_id, site, scheduler, str(job_id), login, run_dir, now, now))
        return self.site_jobs(run_id)[site]

    def set_job_status(self, run_id: str, site: str, *, detail: str, nodes: str) -> None:
        """The job's last seen state line and node list (status, watch)."""
        with write_transaction(self.db):
            self.db.conn.execute("UPDATE site_jobs SET detail = ?, nodes = ?, updated = ? WHERE run_id = ? AND site = ?",
                                 (detail, nodes, time.time(), run_id, site))

    def site_jobs(self, run_id: str) -> dict[str, dict[str, Any]]:
        """{site: its job row (scheduler, job_id, login, run_dir, detail, nodes, submits, ...)} of the run."""
        return {r["site"]: r for r in self._q("SELECT * FROM site_jobs WHERE run_id = ?", (run_id,))}
