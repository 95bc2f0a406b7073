"""The processes of a run, found by the marker launch puts in their environment (dilococtl.procs)."""

from __future__ import annotations

from pathlib import Path

from dilococtl.procs import MARKER_ENV


def marked(run_id: str) -> list[int]:
    """Pids of every process on this machine (every lab node's among them) carrying run `run_id`'s marker."""
    want = f"{MARKER_ENV}={run_id}".encode()
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and want in (d / "environ").read_bytes().split(b"\0"):
                out.append(int(d.name))
        except OSError:
            continue
    return out
