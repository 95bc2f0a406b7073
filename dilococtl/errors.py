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
