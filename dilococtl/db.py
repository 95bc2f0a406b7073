"""The store's SQLite connection: WAL, busy timeout, the schema migrated on open, rows as dicts.

The schema is dilococtl/migrations.py; what is read and written is dilococtl/store.py (the
records) and dilococtl/queries.py (the views' aggregates). Both go through `rows` here.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sqlite_utils import Database

from dilococtl.errors import store_error
from dilococtl.migrations import migrate, write_transaction

BUSY_TIMEOUT_S = 5.0  # a writer waits this long for another process's write lock
DB_MODE = 0o600  # the store and its -wal/-shm files: the owner's only (it names hosts, keys' paths, runs)

__all__ = ["BUSY_TIMEOUT_S", "connect", "rows", "write_transaction"]


def connect(path: str | Path) -> Database:
    """Open (creating and migrating) the database at `path`; a damaged, locked or unwritable file is
    a StoreError naming it and what to do (never raw sqlite text)."""
    path = Path(path)
    conn = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():  # born private: SQLite's WAL/SHM copy its mode
            try:
                os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, DB_MODE))
            except FileExistsError:
                pass  # another process made it first
        conn = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_S, check_same_thread=False)
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        db = Database(conn)
        db.enable_wal()
        _make_private(path)
        conn.execute("PRAGMA synchronous = NORMAL")  # WAL: durable at checkpoints, never corrupt
        migrate(db)
    except (sqlite3.Error, OSError) as e:
        if conn is not None:
            conn.close()
        raise store_error(path, e, BUSY_TIMEOUT_S) from e
    return db


def _make_private(path: Path) -> None:
    """The store's files mode 0600, also those made before this rule (0644); others' files are left alone."""
    for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        try:
            st = os.stat(p)
        except FileNotFoundError:
            continue
        if st.st_uid == os.geteuid() and st.st_mode & 0o777 != DB_MODE:
            os.chmod(p, DB_MODE)


def rows(db: Database, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
    """The rows of one query as dicts keyed by column name."""
    cur = db.conn.execute(sql, tuple(params))
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
