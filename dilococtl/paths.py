"""Where dilococtl keeps its state on the operator's machine."""

from __future__ import annotations

import os
from pathlib import Path


def home(create: bool = True) -> Path:
    """$DILOCOCTL_HOME, default ~/.dilococtl (created on first use unless `create` is False)."""
    p = Path(os.environ.get("DILOCOCTL_HOME") or Path.home() / ".dilococtl").expanduser()
    if create:
        p.mkdir(parents=True, exist_ok=True)
    return p


def db_path(create: bool = True) -> Path:
    """The store; `create=False` for commands that only read (they must not make a home)."""
    return home(create) / "state.db"


def known_hosts_path() -> Path:
    """dilococtl's own known_hosts (OpenSSH format), read beside the user's ~/.ssh/known_hosts."""
    return home() / "known_hosts"


def runs_dir() -> Path:
    """Local run directories (for `local` hosts) and fetched artefacts."""
    p = home() / "runs"
    p.mkdir(parents=True, exist_ok=True)
    return p
