"""The `dilococtl` command: one typer app, one module per command group, imported lazily.

Nothing heavy is imported here (no torch, textual or paramiko) so `dilococtl --help` stays fast:
`COMMANDS` names each command's module and one-line help, `dilococtl --help` lists the table
without importing any command module, and a command's module is imported when it is run or its
own help is asked for (`_Group.get_command`).

Every way in (the console script, `python -m dilococtl`, typer's CliRunner in the tests) goes
through `_Group.main`, the one place where failures become exit codes: a known error (DilocoError)
or a usage error (unknown option or command, missing argument) is ONE line on stderr, never a
Python class name, and exits 2 for bad input (1 failed, 3 unreachable). With `--json` on the
command line the error is also one JSON object on stdout: {"error": "...", "exit": 2}.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

from dilococtl import __version__
from dilococtl.errors import EXIT_BAD_INPUT, EXIT_FAILED, DilocoError

try:  # typer >= 0.20 carries its own copy of click
    from typer._click import core as _click_core
    from typer._click import exceptions as _click_exc
except ImportError:  # pragma: no cover - older typer on top of click
    from click import core as _click_core
    from click import exceptions as _click_exc

EXIT_INTERRUPTED = 130
CONTEXT = {"help_option_names": ["-h", "--help"]}  # inherited by every sub-command and group


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def fail(message: str, code: int, *, json_out: bool) -> int:
    """Report a failure the one way every command does; returns the exit code."""
    line = _one_line(message)
    print(f"error: {line}", file=sys.stderr)
    if json_out:
        sys.stdout.write(json.dumps({"error": line, "exit": code}) + "\n")
    sys.stdout.flush()
    return code


def _usage_message(e: Exception) -> str:
    if isinstance(e, _click_exc.NoSuchOption):
        msg = f"no such option {e.option_name}"
        if e.possibilities:
            msg += f" (did you mean {' or '.join(sorted(e.possibilities))}?)"
    else:
        msg = _one_line(e.format_message()).rstrip(".").replace(". Did you mean", " (did you mean")
        msg += ")" if "(did you mean" in msg else ""
        msg = msg[0].lower() + msg[1:] if msg[:1].isupper() and not msg[1:2].isupper() else msg
    ctx = getattr(e, "ctx", None)
    if ctx is not None:
        msg += f"; see `{ctx.command_path} --help`"
    return msg


def _flags_without_type(cmd: Any) -> None:
    """Show boolean flags as `--json`, not `--json <bool>` (typer prints a type for every option)."""
    # -h/--help is made on demand, from a context; make (and cache) it now to reach it too
    help_opt = cmd.get_help_option(_click_core.Context(cmd, help_option_names=CONTEXT["help_option_names"]))
    for p in [*getattr(cmd, "params", ()), *([help_opt] if help_opt is not None else [])]:
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""
        if hasattr(p, "_usage_display_name"):  # typer >= 0.20 writes a required argument `{RUN}`
            p._usage_display_name = lambda p=p: _usage_name(p)
    for sub in getattr(cmd, "commands", {}).values():
        _flags_without_type(sub)


def _usage_name(p: Any) -> str:
    """An argument in a usage line as the docs write it: SPEC, [RUN], SOURCES..., RUN..."""
    name = (p.metavar or p.name.upper()).removesuffix("...")
    name += "..." if p.nargs != 1 else ""
    return name if p.required else f"[{name}]"


# name -> (module under dilococtl.cli that registers it on `app`, the one line `dilococtl --help`
# shows: the first paragraph of the command's docstring, which a test holds it to). One line each,
# in the order --help lists them.
COMMANDS: dict[str, tuple[str, str]] = {
    "doctor": ("nodes", "Check every node of SPEC: reachable, python, torch, GPUs, disk, clock, trainer; and ports between sites."),
    "provision": ("nodes", "Install this dilococtl's trainer on every node of SPEC (idempotent: unchanged nodes are skipped)."),
    "launch": ("runs", "Record a run and start the Lighthouse and torchrun on every node."),
    "status": ("runs", "Per site: state, round, step, efficiency, last sync seconds, perplexity."),
    "stop": ("runs", "Stop a run: SIGTERM to every process, SIGKILL after the grace period."),
    "logs": ("logs", "A run's rounds (loss, val ppl, sync s, K), events and trainer logs, all sites merged by time."),
    "tune-h": ("tune", "Measure links between site leaders and the inner step time; choose H so sync <= budget x compute."),
    "watch": ("watch", "Dashboard of a run (default: the newest active run, else the newest): sites, curves, events."),
    "report": ("watch", "PNG plots (perplexity vs tokens, efficiency, sync and lost time by cause per round), "
                        "goodput.json and a Markdown summary."),
    "resume": ("resume", "Find the sites of RUN that died and relaunch them from their newest complete checkpoint."),
    "export": ("export", "Write RUN's model as a Hugging Face LlamaForCausalLM directory (safetensors, config, tokenizer)."),
    "sample": ("export", "Generate a continuation of PROMPT with RUN's model (CPU)."),
    "spec": ("spec", "Check run specs (TOML)."),
    "runs": ("records", "List recorded runs, newest first: state, duration, rounds, final perplexity, why it ended."),
    "lab": ("lab", "An emulated multi-site WAN on this host: one network namespace + sshd per node, tbf rates and a user-space delay between sites. Needs root."),
    "data": ("data", "Prepare training data: tokenize text into the shards the trainer reads."),
    "metrics": ("metrics", "Metrics for Prometheus and Grafana."),
    "checkpoints": ("checkpoints", "List RUN's checkpoint rounds in each site's stores: size, age, verified or the reason not."),
}


def load_command_module(name: str) -> bool:
    """Import the module that registers command `name` on `app`; False when it is not installed."""
    import importlib

    mod = f"dilococtl.cli.{COMMANDS[name][0]}"
    try:
        importlib.import_module(mod)
    except ModuleNotFoundError as e:
        if e.name != mod:
            raise
        return False
    return True


class _Group(TyperGroup):
    """The root group: runs the command and turns whatever it raised into one line + exit code.

    Its commands come from `COMMANDS`, each built into a click command on first use."""

    _listing = False  # True while the root help is drawn: commands are then placeholders

    def list_commands(self, ctx: Any) -> list[str]:
        return [*COMMANDS, *(n for n in self.commands if n not in COMMANDS)]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name in self.commands or cmd_name not in COMMANDS:
            return self.commands.get(cmd_name)
        if self._listing:  # the name and one line are all --help draws: import nothing
            return TyperCommand(cmd_name, help=COMMANDS[cmd_name][1])
        if not load_command_module(cmd_name):
            return None
        self._build_registered()
        return self.commands.get(cmd_name)

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        try:
            return self._click_resolve_command(ctx, args)
        except _click_exc.UsageError as e:
            # typer suggests from the commands built so far: none before the first use
            from difflib import get_close_matches

            matches = get_close_matches(args[0], self.list_commands(ctx)) if args else []
            if matches:
                e.message = f"{e.message.rstrip('.')}. Did you mean {', '.join(map(repr, matches))}?"
            raise

    def _build_registered(self) -> None:
        """Turn what the imported modules registered on `app` into click commands (once each)."""
        from typer.main import get_command_from_info, get_command_name, get_group_from_info

        for info in app.registered_commands:
            if (info.name or get_command_name(info.callback.__name__)) not in self.commands:
                cmd = get_command_from_info(info, pretty_exceptions_short=app.pretty_exceptions_short,
                                            rich_markup_mode=app.rich_markup_mode)
                _flags_without_type(cmd)
                self.commands[cmd.name] = cmd
        for group_info in app.registered_groups:
            if group_info.name not in self.commands:
                cmd = get_group_from_info(group_info, pretty_exceptions_short=app.pretty_exceptions_short,
                                          rich_markup_mode=app.rich_markup_mode,
                                          suggest_commands=app.suggest_commands)
                _flags_without_type(cmd)
                self.commands[cmd.name] = cmd

    def format_help(self, ctx: Any, formatter: Any) -> None:
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True, **extra: Any) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        json_out = "--json" in argv[:argv.index("--")] if "--" in argv else "--json" in argv
        _flags_without_type(self)
        try:
            rv = super().main(args=argv, prog_name=prog_name or "dilococtl", complete_var=complete_var,
                              standalone_mode=False, **extra)
            code = rv if isinstance(rv, int) else 0  # typer.Exit(n) comes back as n here
        except SystemExit:  # a command chose its exit code itself (e.g. doctor's 3)
            raise
        except DilocoError as e:
            if os.environ.get("DILOCOCTL_DEBUG"):
                raise
            code = fail(str(e), e.exit_code, json_out=json_out)
        except _click_exc.NoArgsIsHelpError:
            # a bare group (`dilococtl`, `dilococtl lab`): its help is already on stdout; asking
            # what is there is not an error
            code = 0
        except _click_exc.UsageError as e:
            code = fail(_usage_message(e), EXIT_BAD_INPUT, json_out=json_out)
        except _click_exc.ClickException as e:
            code = fail(_usage_message(e), e.exit_code or EXIT_FAILED, json_out=json_out)
        except (KeyboardInterrupt, typer.Abort):
            print("interrupted", file=sys.stderr)
            code = EXIT_INTERRUPTED
        except Exception as e:  # a bug: say so, in one line, with where to get the traceback
            if os.environ.get("DILOCOCTL_DEBUG"):
                raise
            code = fail(f"internal error: {type(e).__name__}: {e} (DILOCOCTL_DEBUG=1 for the traceback)",
                        EXIT_FAILED, json_out=json_out)
        sys.exit(code)


app = typer.Typer(
    name="dilococtl",
    cls=_Group,
    help="Launch and operate DiLoCo training across datacenters joined by slow WAN links.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,
    context_settings=CONTEXT,
    epilog="Example: dilococtl launch playbooks/local-2site.toml --wait",
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


def main() -> None:
    """Console entry (`dilococtl`, `python -m dilococtl`)."""
    app(prog_name="dilococtl")
