"""The store's schema as numbered migrations, applied once each and tracked in `_migrations`.

Same pattern as simonw/llm's migrations.py: a migration is a function `mNNN_what(db)`, appended to
MIGRATIONS by the `@migration` decorator, never edited once released; a schema change is a new
function at the end. Each migration runs in its own write transaction together with the row that
records it, so a crash leaves it either fully applied or not at all, and two processes opening a
fresh database at once apply it once.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from sqlite_utils import Database

MIGRATIONS: list[Callable[[Database], None]] = []


def migration(fn: Callable[[Database], None]) -> Callable[[Database], None]:
    MIGRATIONS.append(fn)
    return fn


@contextlib.contextmanager
def write_transaction(db: Database) -> Iterator[Database]:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error); nested use joins the outer transaction.

    IMMEDIATE takes the write lock at the start, so a concurrent writer waits out the busy timeout
    there instead of failing later when a read transaction would have to become a write one.
    """
    conn = db.conn
    if conn.in_transaction:
        yield db
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def migrate(db: Database) -> list[str]:
    """Apply the migrations `db` has not seen yet; returns their names (empty when up to date)."""
    db.conn.execute("CREATE TABLE IF NOT EXISTS _migrations (name TEXT PRIMARY KEY, applied REAL NOT NULL)")
    done = []
    for fn in MIGRATIONS:
        with write_transaction(db):
            # read inside the write lock: another process may have applied it meanwhile
            if db.conn.execute("SELECT 1 FROM _migrations WHERE name = ?", (fn.__name__,)).fetchone():
                continue
            fn(db)
            db.conn.execute("INSERT INTO _migrations (name, applied) VALUES (?, ?)", (fn.__name__, time.time()))
        done.append(fn.__name__)
    return done


@migration
def m001_initial(db: Database) -> None:
    """Runs, their sites and nodes, launches, metrics (rounds, steps, events), collector offsets, tunes.

    Times are unix seconds (REAL). Columns ending in _json hold JSON text.
    """
    db["runs"].create({
        "id": str, "name": str, "spec_path": str, "spec_json": str, "state": str,
        "created": float, "updated": float, "finished": float, "exit_reason": str, "lighthouse_json": str,
    }, pk="id", not_null={"name", "spec_json", "state", "created", "updated"})
    db["runs"].create_index(["name", "created"])
    db["sites"].create({
        "run_id": str, "name": str, "idx": int, "state": str, "hosts_json": str, "nproc": int,
    }, pk=("run_id", "name"), not_null={"idx", "state", "hosts_json", "nproc"},
        foreign_keys=[("run_id", "runs", "id")])
    db["nodes"].create({
        "run_id": str, "site": str, "host": str, "rank": int, "pid": int, "log_path": str, "run_dir": str,
        "state": str,
    }, pk=("run_id", "site", "host"), not_null={"rank", "state"}, foreign_keys=[("run_id", "runs", "id")])
    db["launches"].create({
        "id": int, "run_id": str, "attempt": int, "site": str, "started": float, "reason": str, "ok": int,
        "message": str,
    }, pk="id", not_null={"run_id", "attempt", "started"}, foreign_keys=[("run_id", "runs", "id")])
    db["launches"].create_index(["run_id", "site"])
    db["rounds"].create({
        "run_id": str, "site": str, "round": int, "step": int, "h": int, "compute_s": float, "sync_s": float,
        "bytes_sent": int, "bytes_recv": int, "k_active": int, "k_nominal": int, "outer_lr": float,
        "committed": int, "staleness": int, "train_loss": float, "val_loss": float, "val_ppl": float,
        "tokens": int, "t": float,
    }, pk=("run_id", "site", "round"), foreign_keys=[("run_id", "runs", "id")])
    db["steps"].create({
        "run_id": str, "site": str, "step": int, "round": int, "loss": float, "lr": float, "step_s": float,
        "tokens_per_s": float, "t": float,
    }, pk=("run_id", "site", "step"), foreign_keys=[("run_id", "runs", "id")])
    db["events"].create({
        "id": int, "run_id": str, "site": str, "event": str, "message": str, "detail_json": str, "round": int,
        "t": float,
    }, pk="id", not_null={"run_id", "site", "event", "t"}, foreign_keys=[("run_id", "runs", "id")])
    db["events"].create_index(["run_id", "site", "t", "event"], unique=True)
    db["offsets"].create({
        "run_id": str, "site": str, "host": str, "path": str, "offset": int,
    }, pk=("run_id", "site", "host", "path"), not_null={"offset"}, foreign_keys=[("run_id", "runs", "id")])
    db["tunes"].create({
        "id": int, "created": float, "spec_path": str, "links_json": str, "step_s": float,
        "payload_bytes": int, "h": int, "budget": float, "prediction_json": str,
    }, pk="id", not_null={"created"})


@migration
def m002_view_indexes(db: Database) -> None:
    """Indexes for views over long runs (watch, report; dilococtl/queries.py).

    rounds_series covers the columns the plots fold into buckets, so a range of rounds is read from
    the index alone; events(run_id, id) lets a view poll new events and take the newest N without
    sorting a run's whole history (a checkpoint event per site per round adds up).
    """
    db["rounds"].create_index(["run_id", "site", "round", "tokens", "val_ppl", "compute_s", "sync_s",
                               "bytes_sent", "bytes_recv", "t"], index_name="rounds_series")
    db["events"].create_index(["run_id", "id"], index_name="events_run_id")


@migration
def m003_rounds_by_round(db: Database) -> None:
    """An index for the run-wide round time (dilococtl.queries.round_times, dilococtl.metrics).

    The views sum the sites' sync seconds and round seconds (compute + sync) over the records of each
    bucket of rounds, all sites together: a GROUP BY over rounds in round order, which rounds_series
    (by site first) can only serve by sorting. This index covers those columns in round order.
    (Its docstring once said the round time took the slowest site's compute and the least sync of
    each round; that fold was replaced by the records' sums, the index serves both.)
    """
    db["rounds"].create_index(["run_id", "round", "compute_s", "sync_s"], index_name="rounds_by_round")


@migration
def m004_round_parts(db: Database) -> None:
    """When each site entered a round's exchange and its parts (trainer.records.RoundRecord:
    exchange_t, quorum_s, weight_s, payload_s), so a round can be replayed in tune-h's model from
    the sites' arrivals (dilococtl.tune.history.rounds_against_model). Rows from before stay NULL."""
    for col in ("exchange_t", "quorum_s", "weight_s", "payload_s"):
        db["rounds"].add_column(col, float)


@migration
def m005_site_jobs(db: Database) -> None:
    """A scheduler's job per site (issue 37): a Slurm site runs as one batch job submitted through its
    login node, so what identifies its processes is the job id, not pids. `login` is the host the job
    is queried and cancelled through; `detail` and `nodes` are the job's last seen state line (state,
    pending reason, node list) and allocation, shown by status and watch; `submits` counts the site's
    submissions in this run (launch and each resubmission by resume)."""
    db["site_jobs"].create({
        "run_id": str, "site": str, "scheduler": str, "job_id": str, "login": str, "run_dir": str,
        "detail": str, "nodes": str, "submits": int, "submitted": float, "updated": float,
    }, pk=("run_id", "site"), not_null={"scheduler", "job_id", "login", "submits", "submitted"},
        foreign_keys=[("run_id", "runs", "id")])


@migration
def m006_round_exchange_bytes(db: Database) -> None:
    """The bytes of each of a round's exchanges (trainer.records.RoundRecord.exchange_bytes: with
    diloco.fragments a round makes F, and the largest is what a link must carry at once), as a JSON
    list; NULL for a round of one exchange and for rows from before."""
    db["rounds"].add_column("exchange_bytes", str)


@migration
def m007_link_probes(db: Database) -> None:
    """Links measured by `doctor --links` (dilococtl.tune.Link as JSON, every direction between the
    spec's site leaders, with the stream sweep), from which launch derives the TLS transport's streams
    and pacing for a spec that sets neither and was never tuned (dilococtl.derive_transport)."""
    db["link_probes"].create({"id": int, "created": float, "spec_path": str, "links_json": str},
                             pk="id", not_null={"created", "links_json"})
