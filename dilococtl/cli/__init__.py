"""The `dilococtl` command: one typer app, one module per command group, imported lazily.

Nothing heavy is imported here (no torch, textual or paramiko) so `dilococtl --help` stays fast.
"""

from __future__ import annotations

import os
import sys

import typer

from dilococtl import __version__
from dilococtl.errors import EXIT_FAILED, DilocoError

app = typer.Typer(
    name="dilococtl",
    help="Launch and operate DiLoCo training across datacenters joined by slow WAN links.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        print(__version__)
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Launch and operate DiLoCo training across datacenters joined by slow WAN links."""


def _register() -> None:
    # Each module adds its commands to `app`; they import their heavy dependencies inside the
    # command functions only.
    import importlib

    for mod in ("spec", "nodes", "runs", "lab", "tune", "watch", "resume"):
        try:
            importlib.import_module(f"dilococtl.cli.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"dilococtl.cli.{mod}":
                raise


_register()


def main() -> None:
    """Console entry: known errors become one line on stderr and their exit code."""
    try:
        # standalone_mode=False returns typer.Exit's code instead of raising it
        rc = app(standalone_mode=False)
        sys.exit(rc if isinstance(rc, int) else 0)
    except DilocoError as e:
        if os.environ.get("DILOCOCTL_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as e:  # click usage errors and the unexpected
        import click

        if isinstance(e, click.exceptions.Abort):
            sys.exit(130)
        if isinstance(e, click.ClickException):
            e.show()
            sys.exit(2)
        if os.environ.get("DILOCOCTL_DEBUG"):
            raise
        print(f"error: {type(e).__name__}: {e} (DILOCOCTL_DEBUG=1 for the traceback)", file=sys.stderr)
        sys.exit(EXIT_FAILED)
