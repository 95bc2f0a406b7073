"""Process identity: signal a run's process only after checking that it is the one the run started.

A run records the pid of every process it starts (the Lighthouse or outer service, one wrapper shell
per node). Long after, `stop` or a refresh signals those pids; by then the process may have ended
and the OS may have given its pid to an unrelated process. So before any signal the node checks, in
the same shell command that sends it, that the pid is still the run's:

- it leads its own process group (launch starts every process with setsid), and
- it carries the run's marker: `DILOCOCTL_RUN_ID=<run id>` in its environment (every process launch
  starts gets it, and keeps it across exec), or, for processes started before the marker existed,
  the run's directory (`.../runs/<run id>`) in its command line.

Run ids are unique, so a process that passes both checks was started by this run. Anything else is
reported as foreign and left alone. The group is then signalled (`kill -- -PID`), as before.
"""

from __future__ import annotations

import shlex
from typing import Literal

from dilococtl.nodes import Node

MARKER_ENV = "DILOCOCTL_RUN_ID"
Identity = Literal["ours", "gone", "foreign"]
_RC = {0: "ours", 3: "gone", 4: "foreign"}


def marker_env(run_id: str) -> dict[str, str]:
    """The environment every process of run `run_id` is started with (start_detached's env)."""
    return {MARKER_ENV: run_id}


def _check_script(pid: int, run_id: str) -> str:
    """Shell: exit 0 when `pid` is run `run_id`'s process, 3 when gone (or a zombie), 4 when foreign."""
    p = int(pid)
    marker = shlex.quote(f"{MARKER_ENV}={run_id}")
    run_dir = shlex.quote(f"/runs/{run_id}")
    # /proc/PID/stat after the ")" that ends the command name: state ppid pgrp ...
    return (f"st=$(sed 's/.*) //' /proc/{p}/stat 2>/dev/null) || exit 3; set -- $st; "
            f'[ -n "$1" ] && [ "$1" != Z ] && [ "$1" != X ] || exit 3; '
            f'[ "$3" = {p} ] || exit 4; '
            f"{{ tr '\\0' '\\n' < /proc/{p}/environ 2>/dev/null | grep -qxF {marker} || "
            f"tr '\\0' ' ' < /proc/{p}/cmdline 2>/dev/null | grep -qF {run_dir}; }} || exit 4")


def identify(node: Node, pid: int, run_id: str) -> Identity:
    """Whether `pid` on `node` is run `run_id`'s process ("ours"), has ended ("gone") or is another's."""
    return _RC.get(node.run(_check_script(pid, run_id), timeout=30).rc, "foreign")


def signal_if_ours(node: Node, pid: int, run_id: str, sig: str = "TERM") -> Identity:
    """Send `sig` to the process group of `pid` only if it is run `run_id`'s process (checked on the
    node in the same command). Returns what the check found; nothing is signalled unless "ours"."""
    name = sig.upper().removeprefix("SIG")
    if name not in ("TERM", "KILL", "INT", "HUP", "USR1", "USR2", "CONT", "STOP"):
        raise ValueError(f"bad signal name {sig!r}")
    r = node.run(f"{_check_script(pid, run_id)}; kill -s {name} -- -{int(pid)} 2>/dev/null; exit 0", timeout=30)
    return _RC.get(r.rc, "foreign")
