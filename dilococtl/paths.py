"""Where dilococtl keeps its state on the operator's machine."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """$DILOCOCTL_HOME, default ~/.dilococtl (created on first use)."""
    p = Path(os.environ.get("DILOCOCTL_HOME") or Path.home() / ".dilococtl").expanduser()
    p.mkdir(parents=True, exist_ok=True)
    return p


def db_path() -> Path:
    return home() / "state.db"


def known_hosts_path() -> Path:
    """dilococtl's own known_hosts (OpenSSH format), read beside the user's ~/.ssh/known_hosts."""
    return home() / "known_hosts"


def runs_dir() -> Path:
    """Local run directories (for `local` hosts) and fetched artefacts."""
    p = home() / "runs"
    p.mkdir(parents=True, exist_ok=True)
    return p
