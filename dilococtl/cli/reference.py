"""docs/cli.md, generated from the command objects themselves: `python -m dilococtl.cli.reference`.

Every command and sub-command of the `dilococtl` app, in the order `--help` lists them, each with
its usage line, its help text and a table of its arguments and options (names, type or metavar,
default, help). It is built from the click objects typer makes (`typer.main.get_command(app)`, the
same tree `dilococtl` runs) and their params, never from rendered help: nothing depends on the
terminal's width, colour or the environment. Rich markup in help texts (`RATE\\[/RTT]`) is read as
`--help` reads it, so the reference says what the screen says.

`make docs` rewrites docs/cli.md; tests/unit/test_cli_reference.py fails when the file and this
generator, or the file and the live `dilococtl CMD --help`, disagree.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from typing import Any

HEADER = """\
# dilococtl command reference

Generated from the commands themselves by `python -m dilococtl.cli.reference` (`make docs`); do not
edit by hand. tests/unit/test_cli_reference.py fails when this file drifts from the code or from
`dilococtl CMD --help`. Every command also takes `-h`/`--help` and prints the same text on the
terminal.
"""

_HELP_OPTS = {"-h", "--help"}


def _plain(text: str, markup_mode: str | None) -> str:
    """Help text as `--help` shows it: rich markup read (escapes undone, tags dropped), not styled."""
    text = inspect.cleandoc(text or "")
    if markup_mode == "markdown" or not text:
        return text
    try:
        from rich.text import Text
    except ImportError:  # pragma: no cover - typer without rich prints the text as it is
        return text
    return Text.from_markup(text).plain


_CODE_SPAN = re.compile(r"(`[^`]*`)")


def _md(text: str, *, cell: bool = False) -> str:
    """Prose as markdown: `\\`, `*` and a tag-like `<` outside code spans escaped (a help text is not
    markup), and in a table cell one line with `|` escaped."""
    if cell:
        text = " ".join(text.split())
    parts = []
    for i, part in enumerate(_CODE_SPAN.split(text)):
        if i % 2 == 0:  # outside a code span
            part = part.replace("\\", "\\\\").replace("*", "\\*")
            part = re.sub(r"<(?=[A-Za-z/!?])", "&lt;", part)  # what could open an HTML tag
        if cell:
            part = part.replace("|", "\\|")
        parts.append(part)
    return "".join(parts)


def _code(text: str) -> str:
    """`text` as an inline code span, in a table cell (`|` escaped, as GitHub's tables want)."""
    return f"`{text.replace('|', chr(92) + '|')}`" if text else ""


def _paragraphs(text: str) -> list[str]:
    """A docstring's paragraphs, each on one line; `Example: CMD` paragraphs with CMD as code."""
    out = []
    for para in text.split("\n\n"):
        para = " ".join(para.split())
        if not para:
            continue
        m = re.fullmatch(r"Example: (.+)", para)
        if m and "`" not in m.group(1):
            out.append(f"Example: `{m.group(1)}`")
        else:
            out.append(_md(para))
    return out


def _markup_mode(cmd: Any) -> str | None:
    return getattr(cmd, "rich_markup_mode", None)


def _is_group(cmd: Any) -> bool:
    return hasattr(cmd, "list_commands") and hasattr(cmd, "get_command")


def walk(root: Any | None = None) -> Iterator[tuple[Any, Any]]:
    """(context, command) of every visible command, depth first, in the order `--help` lists them;
    the root first. Each command's module is imported as a call would import it."""
    yield from _walk(root if root is not None else root_command(), None, "dilococtl")


def _walk(cmd: Any, parent: Any, name: str) -> Iterator[tuple[Any, Any]]:
    ctx = _context(cmd, parent, name)
    yield ctx, cmd
    if _is_group(cmd):
        for sub_name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, sub_name)
            if sub is None or getattr(sub, "hidden", False):
                continue
            yield from _walk(sub, ctx, sub_name)


def _context(cmd: Any, parent: Any, name: str) -> Any:
    """The context a call makes for `cmd` (its own settings, the rest inherited: -h/--help)."""
    try:  # typer >= 0.20 carries its own copy of click (as dilococtl/cli/__init__.py)
        from typer._click.core import Context
    except ImportError:  # pragma: no cover - older typer on top of click
        from click.core import Context

    return Context(cmd, parent=parent, info_name=name, **(getattr(cmd, "context_settings", None) or {}))


def root_command() -> Any:
    """The click group `dilococtl` runs. Its commands are built on first use, as in a call (each with
    its flags shown as the CLI shows them: `_Group.get_command`)."""
    import typer.main

    from dilococtl.cli import app

    return typer.main.get_command(app)


_RANGE = re.compile(r"(?:\S+<=?)?x[<>]=?\S+")  # click's `x>=1`, `0<=x<=10`


def _extras(help_text: str, own: str) -> tuple[str, bool, list[str]]:
    """(default, required, other notes: env var, range) from the bracket click appends to a help:
    `[env var: X; default: 30.0; x>=0; required]`."""
    rest = help_text[len(own):].strip() if help_text.startswith(own) else help_text
    m = re.fullmatch(r"\[(.*)\]", rest, flags=re.S)
    if not m:
        return "", False, []
    default, required, notes, in_default = "", False, [], False
    for item in m.group(1).split("; "):
        if item == "required":
            required = True
        elif item.startswith("default: "):
            default, in_default = item.removeprefix("default: "), True
            continue
        elif in_default and not _RANGE.fullmatch(item):  # a default that holds "; "
            default += "; " + item
            continue
        else:
            notes.append(item)
        in_default = False
    return default, required, notes


def _param_row(param: Any, ctx: Any, markup_mode: str | None) -> tuple[str, str, str, str] | None:
    """(names, type, default, help) of one argument or option; None when --help hides it."""
    record = param.get_help_record(ctx)
    if record is None or getattr(param, "hidden", False):
        return None
    label, help_text = record
    own = inspect.cleandoc(getattr(param, "help", None) or "")
    default, required, notes = _extras(help_text, own)
    if param.param_type_name == "argument":
        names, _, type_ = label.partition(" ")
    elif getattr(param, "secondary_opts", None) or getattr(param, "is_flag", False) or getattr(param, "count", False):
        names, type_ = label, ""
    else:  # `-s, --site <str>`: the names as click joins them (short ones first), then the type
        names = ", ".join(sorted(param.opts, key=lambda o: len(o) - len(o.lstrip(o[:1]))))
        if label.startswith(names + " "):
            type_ = label[len(names):].strip()
        else:  # pragma: no cover - another click's layout: the label as it is
            names, type_ = label, ""
    desc = _md(_plain(own, markup_mode), cell=True)
    if notes:
        desc = f"{desc} ({_md('; '.join(notes), cell=True)})" if desc else _md("; ".join(notes), cell=True)
    return names, type_, ("required" if required else (_code(default) if default else "")), desc


def _table(title: str, rows: list[tuple[str, str, str, str]]) -> list[str]:
    if not rows:
        return []
    out = [f"| {title} | Type | Default | Description |", "| --- | --- | --- | --- |"]
    out += [f"| {_code(n)} | {_code(t)} | {d} | {h} |" for n, t, d, h in rows]
    return [*out, ""]


def _anchor(path: str) -> str:
    """GitHub's anchor of a `## PATH` heading."""
    return re.sub(r"[^\w\- ]", "", path.lower()).replace(" ", "-")


def _usage(cmd: Any, ctx: Any) -> str:
    return " ".join([ctx.command_path, *cmd.collect_usage_pieces(ctx)])


def _summary(cmd: Any) -> str:
    """The first paragraph of a command's help, as `dilococtl --help` lists it."""
    text = _plain(cmd.short_help or cmd.help or "", _markup_mode(cmd))
    return " ".join(text.split("\n\n")[0].split())


def section(cmd: Any, ctx: Any) -> list[str]:
    """The markdown of one command: heading, usage, help, arguments, options, sub-commands."""
    mode = _markup_mode(cmd)
    out = [f"## {ctx.command_path}", "", "```text", _usage(cmd, ctx), "```", ""]
    for para in [*_paragraphs(_plain(cmd.help or "", mode)), *_paragraphs(_plain(cmd.epilog or "", mode))]:
        out += [para, ""]
    args, opts = [], []
    for param in cmd.get_params(ctx):
        if set(getattr(param, "opts", ())) & _HELP_OPTS:
            continue  # -h/--help: every command has it (said once, at the top)
        row = _param_row(param, ctx, mode)
        if row is not None:
            (args if param.param_type_name == "argument" else opts).append(row)
    out += _table("Argument", args)
    out += _table("Option", opts)
    if _is_group(cmd) and ctx.parent is not None:  # the root's commands are the index at the top
        subs = []
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is not None and not getattr(sub, "hidden", False):
                path = f"{ctx.command_path} {name}"
                subs.append(f"| [`{name}`](#{_anchor(path)}) | {_md(_summary(sub), cell=True)} |")
        if subs:
            out += ["| Command | What it does |", "| --- | --- |", *subs, ""]
    return out


def reference() -> str:
    """docs/cli.md's text."""
    commands = list(walk())
    out = [HEADER]
    out += ["| Command | What it does |", "| --- | --- |"]
    for ctx, cmd in commands[1:]:
        out.append(f"| [`{ctx.command_path}`](#{_anchor(ctx.command_path)}) | {_md(_summary(cmd), cell=True)} |")
    out.append("")
    for ctx, cmd in commands:
        out += section(cmd, ctx)
    return "\n".join(out).rstrip("\n") + "\n"


def main() -> None:
    import sys

    sys.stdout.write(reference())


if __name__ == "__main__":
    main()
