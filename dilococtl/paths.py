"""Where dilococtl keeps its state on the operator's machine, private to the user who runs it.

The home holds the store, known_hosts, every run's keys and local run directories: it is made 0700,
and an existing one is set back to 0700 when it is opened (homes made before this were 0755). A
directory another user owns, or that others may write, could be swapped under us (a planted run tree
whose checkpoint root would then load): `check_private_dir` refuses it in one line.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from dilococtl.errors import BadInput

HOME_MODE = 0o700  # the home and every directory dilococtl makes under it
WORK_SUBDIR = "work"  # the default work_dir of local sites: HOME/work (spec_sites.py)


def private_dir(p: Path) -> Path:
    """`p` made (with its missing parents) mode 0700, or set to 0700 if it is ours; refused if it is not."""
    p = Path(p)
    p.mkdir(mode=HOME_MODE, parents=True, exist_ok=True)
    check_private_dir(p, fix=True)
    return p


def check_private_dir(p: Path, fix: bool = False) -> None:
    """BadInput unless `p` is a directory this user owns that no one else may write (`fix`: chmod 0700)."""
    try:
        st = os.stat(p)
    except OSError as e:
        raise BadInput(f"{p}: cannot use it: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise BadInput(f"{p}: not a directory")
    if st.st_uid != os.geteuid():
        raise BadInput(f"{p}: owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}): refusing to use it")
    if fix and stat.S_IMODE(st.st_mode) != HOME_MODE:
        os.chmod(p, HOME_MODE)
    elif st.st_mode & 0o022:
        raise BadInput(f"{p}: mode {stat.S_IMODE(st.st_mode):o} lets other users write it: refusing to use it "
                       f"(chmod go-w)")


def home(create: bool = True) -> Path:
    """$DILOCOCTL_HOME, default ~/.dilococtl (created 0700 on first use unless `create` is False)."""
    p = Path(os.environ.get("DILOCOCTL_HOME") or Path.home() / ".dilococtl").expanduser()
    if create:
        private_dir(p)
    return p


def db_path(create: bool = True) -> Path:
    """The store; `create=False` for commands that only read (they must not make a home)."""
    return home(create) / "state.db"


def known_hosts_path() -> Path:
    """dilococtl's own known_hosts (OpenSSH format), read beside the user's ~/.ssh/known_hosts."""
    return home() / "known_hosts"


def runs_dir() -> Path:
    """Local run directories (for `local` hosts) and fetched artefacts."""
    return private_dir(home() / "runs")


def default_work_dir() -> Path:
    """work_dir of a local site that names none: HOME/work (not /tmp, where another user could make it first)."""
    return home(create=False) / WORK_SUBDIR


def run_ca_dir(run_id: str) -> Path:
    """Where the control plane keeps a run's CA, its sites' certificates and keys, and its checkpoint key."""
    return home() / "run_ca" / run_id


def service_keys_dir(run_id: str) -> Path:
    """Where the control plane keeps a run's outer-service certificate, key and token."""
    return home() / "service_keys" / run_id
