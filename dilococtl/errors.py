"""Known failures: each carries its exit code and prints as one line (tracebacks: DILOCOCTL_DEBUG=1)."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1  # the command or the run failed
EXIT_BAD_INPUT = 2  # bad spec, flag or argument
EXIT_UNREACHABLE = 3  # a node could not be reached


class DilocoError(Exception):
    """A failure the user can act on; `exit_code` says which kind."""

    exit_code = EXIT_FAILED


class BadInput(DilocoError):
    exit_code = EXIT_BAD_INPUT


class Unreachable(DilocoError):
    exit_code = EXIT_UNREACHABLE


class HostKeyError(Unreachable):
    """An SSH host key is unknown (and first-use trust was not asked for) or has changed."""


class StoreError(DilocoError):
    """The store (state.db) cannot be used: damaged, locked or unwritable. The line names the file
    and what to do."""


def store_error(path: object, e: BaseException, busy_timeout_s: float | None = None) -> StoreError:
    """One line for a sqlite3 or OS error on the store at `path`: what is wrong, and what to do."""
    text = " ".join(str(e).split()) or type(e).__name__
    low = text.lower()
    if "not a database" in low or "malformed" in low or "corrupt" in low:
        return StoreError(f"{path}: the store is damaged ({text}); move it aside (mv {path} {path}.damaged) "
                          "and dilococtl starts a new one, or restore a copy")
    if isinstance(e, (FileExistsError, NotADirectoryError)):
        return StoreError(f"{path}: not a directory, where dilococtl keeps its records ({text}); set "
                          "DILOCOCTL_HOME to a directory")
    if "locked" in low or "busy" in low:
        waited = f" for {busy_timeout_s:g}s" if busy_timeout_s else ""
        return StoreError(f"{path}: the store is locked by another process{waited} ({text}); let it finish "
                          f"(`fuser {path}` names it) and try again")
    if "readonly" in low or "read-only" in low or "unable to open" in low or isinstance(e, PermissionError) \
            or "permission" in low:
        return StoreError(f"{path}: the store cannot be opened or written ({text}); make {path} and its directory "
                          "writable, or set DILOCOCTL_HOME to a writable directory")
    return StoreError(f"{path}: store error ({text})")
