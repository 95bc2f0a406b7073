"""The command line as a user meets it: every --help renders, usage errors are one line and exit 2,
bare groups show their help, `--json` errors are JSON, read-only commands create nothing."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from dilococtl.cli import app
from dilococtl.errors import EXIT_BAD_INPUT

ROOT = Path(__file__).resolve().parents[2]


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def commands(cmd=None, path=()):
    """(path, command) of every command and group, the root included; the root's commands resolved
    as a call resolves them (imported on first use, `cli.COMMANDS`)."""
    cmd = cmd or typer.main.get_command(app)
    yield path, cmd
    if hasattr(cmd, "list_commands"):
        ctx = typer.Context(cmd)
        for name in sorted(cmd.list_commands(ctx)):
            yield from commands(cmd.get_command(ctx, name), (*path, name))


ALL = [p for p, _ in commands()]


def test_the_tree_has_the_commands_the_readme_names():
    names = {" ".join(p) for p in ALL}
    for want in ("spec check", "doctor", "provision", "tune-h", "launch", "runs", "status", "logs", "stop",
                 "watch", "report", "resume", "lab up", "lab status", "lab shape", "lab cut", "lab heal",
                 "lab kill", "lab down"):
        assert want in names


@pytest.mark.parametrize("path", ALL, ids=lambda p: " ".join(p) or "root")
def test_every_help_renders(path):
    for flag in ("--help", "-h"):
        r = invoke(*path, flag)
        assert r.exit_code == 0, (flag, r.output)
        assert "Usage: dilococtl" in r.stdout and "error" not in r.stderr.lower()
    # flags show as flags: no `--json <bool>`
    assert "<bool>" not in r.stdout


@pytest.mark.parametrize("path", [p for p, c in commands() if not getattr(c, "commands", None)],
                         ids=lambda p: " ".join(p))
def test_every_command_has_json_and_an_example(path):
    r = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
    assert "--json" in r.stdout
    assert "Example: dilococtl " + " ".join(path) in r.stdout


@pytest.mark.parametrize("path", [p for p, c in commands() if not getattr(c, "commands", None)],
                         ids=lambda p: " ".join(p))
def test_usage_lines_name_arguments_as_the_docs_do(path):
    """Issue 42: typer wrote `{run}`, `{RUN}`, `{sources}...`, `{RUN...}...`."""
    r = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
    usage = next(ln for ln in r.stdout.splitlines() if "Usage:" in ln)
    assert "{" not in usage and "}" not in usage and "......" not in usage, usage
    assert not any(w.islower() for w in usage.split()[3 + len(path):] if w.isalpha()), usage


def test_readme_table_mentions_every_flag_a_script_needs():
    """`runs rm` asks first and needs --yes off a terminal: the README's table says so."""
    readme = (ROOT / "README.md").read_text()
    row = next(ln for ln in readme.splitlines() if ln.startswith("| `runs ["))
    assert "`runs rm RUN... [--files] [--yes]`" in row
    r = invoke("runs", "rm", "--help")
    assert "--yes" in r.stdout


def test_the_spec_argument_has_one_name():
    for path, cmd in commands():
        for p in getattr(cmd, "params", ()):
            if p.param_type_name == "argument" and "spec" in (p.name or ""):
                assert p.metavar == "SPEC", path


@pytest.mark.parametrize("args, message", [
    (["status", "--jsn"], "error: no such option --jsn (did you mean --json?); see `dilococtl status --help`"),
    (["stauts"], "error: no such command 'stauts' (did you mean 'status'?); see `dilococtl --help`"),
    (["stop"], "error: missing argument 'RUN'; see `dilococtl stop --help`"),
    (["lab", "kill", "site1", "--grace", "soon"], "error: invalid value for '--grace': "),
])
def test_usage_errors_are_one_line_and_exit_2(args, message):
    r = invoke(*args)
    assert r.exit_code == EXIT_BAD_INPUT
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), r.stderr
    assert "Error" not in r.stderr and "NoSuchOption" not in r.stderr and "UsageError" not in r.stderr


@pytest.mark.parametrize("group", [[], ["spec"], ["lab"]])
def test_a_bare_group_shows_its_help_and_exits_0(group):
    r = invoke(*group)
    assert r.exit_code == 0
    assert "Usage: dilococtl" in r.stdout and "Commands" in r.stdout
    assert r.stderr == ""


def test_json_errors_are_json_on_stdout(tmp_path):
    r = invoke("status", "nosuchrun", "--json")
    assert r.exit_code == EXIT_BAD_INPUT
    assert json.loads(r.stdout) == {
        "error": "no run 'nosuchrun': no runs recorded yet (start one with `dilococtl launch SPEC`)",
        "exit": EXIT_BAD_INPUT}
    r = invoke("status", "--jsn", "--json")
    assert json.loads(r.stdout)["exit"] == EXIT_BAD_INPUT
    r = invoke("spec", "check", str(tmp_path / "missing.toml"), "--json")
    assert r.exit_code == EXIT_BAD_INPUT
    assert json.loads(r.stdout) == {"error": f"{tmp_path / 'missing.toml'}: no such run spec", "exit": 2}


def test_read_only_commands_create_nothing(tmp_path):
    home = Path(os.environ["DILOCOCTL_HOME"])
    r = invoke("runs")
    assert r.exit_code == 0 and "no runs recorded yet" in r.stderr
    assert json.loads(invoke("runs", "--json").stdout) == []
    for args in (["status"], ["logs"], ["report"], ["report", "x"], ["watch", "--json"], ["logs", "x"]):
        r = invoke(*args)
        assert r.exit_code == EXIT_BAD_INPUT, (args, r.output)
        assert r.stderr.startswith("error: no run"), r.stderr
    assert not home.exists()


def test_the_console_script_exits_as_cliruner_does(tmp_path):
    env = {**os.environ, "DILOCOCTL_HOME": str(tmp_path / "h")}
    p = subprocess.run([sys.executable, "-m", "dilococtl", "status", "--jsn"], cwd=ROOT, capture_output=True,
                       text=True, env=env, timeout=60)
    assert p.returncode == EXIT_BAD_INPUT
    assert p.stderr.strip() == "error: no such option --jsn (did you mean --json?); see `dilococtl status --help`"
    p = subprocess.run([sys.executable, "-m", "dilococtl"], cwd=ROOT, capture_output=True, text=True, env=env,
                       timeout=60)
    assert p.returncode == 0 and "Usage: dilococtl" in p.stdout and p.stderr == ""


def test_completion_is_offered_and_completes(tmp_path):
    r = invoke("--help")
    assert "--install-completion" in r.stdout and "--show-completion" in r.stdout
    env = {**os.environ, "DILOCOCTL_HOME": str(tmp_path / "h"), "_DILOCOCTL_COMPLETE": "complete_bash",
           "COMP_WORDS": "dilococtl lo", "COMP_CWORD": "1"}
    p = subprocess.run([sys.executable, "-m", "dilococtl"], cwd=ROOT, capture_output=True, text=True, env=env,
                       timeout=60)
    assert p.returncode == 0 and p.stdout.split() == ["logs"], p.stderr


def test_resume_of_a_finished_run_is_nothing_to_do_with_or_without_auto():
    from dilococtl.store import Store
    from tests.tui.fixtures import make_run

    home = Path(os.environ["DILOCOCTL_HOME"])
    with Store.open(home / "state.db") as store:
        run = make_run(store, state="finished")
    for args in ([], ["--auto"]):  # no node is asked: the store says it finished
        r = invoke("resume", run.id, *args)
        assert r.exit_code == 0 and r.stdout.strip() == f"nothing to resume: run {run.id} finished", r.output
    assert json.loads(invoke("resume", run.id, "--json").stdout)["relaunched"] == []


def test_launch_shows_the_plan_and_asks_on_a_terminal(tmp_path):
    """On a terminal `launch` shows the plan and waits for an answer; "n" starts nothing."""
    import pty
    import select

    spec = tmp_path / "s.toml"
    spec.write_text((ROOT / "tests" / "tui" / "fixtures.py").read_text().split('SPEC_TOML = """')[1].split('"""')[0])
    env = {**os.environ, "DILOCOCTL_HOME": str(tmp_path / "h"), "COLUMNS": "200"}
    pid, fd = pty.fork()
    if pid == 0:  # the child: dilococtl on a terminal
        os.chdir(ROOT)
        os.execve(sys.executable, [sys.executable, "-m", "dilococtl", "launch", str(spec)], env)
    seen = b""
    deadline = time.monotonic() + 60
    while b"[y/N]" not in seen and time.monotonic() < deadline:
        if select.select([fd], [], [], 1)[0]:
            seen += os.read(fd, 4096)
    os.write(fd, b"n\n")
    while time.monotonic() < deadline:
        try:
            if select.select([fd], [], [], 1)[0]:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                seen += chunk
        except OSError:  # the child closed the terminal
            break
    _, status = os.waitpid(pid, 0)
    text = seen.decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 1, text
    assert "plan: local-2site: 2 site(s), 2 node(s), 2 process(es); H 20, 10 rounds, mode sync" in text
    assert "writes to: local:/tmp/dilococtl-test/runs/RUN_ID" in text
    assert "start 2 process(es) on 2 node(s)? [y/N]" in text and "nothing started" in text
    from dilococtl.store import Store

    with Store.open(tmp_path / "h" / "state.db") as store:
        assert store.list_runs() == []  # nothing recorded, nothing started


@pytest.mark.parametrize("table, key, hint", [
    ("diloco", "roundz", "diloco.roundz: unknown key 'roundz' (did you mean 'rounds'?)"),
    ("run", "nmae", "run.nmae: unknown key 'nmae' (did you mean 'name'?)"),
    ("train", "learning_rate_xyz", "train.learning_rate_xyz: unknown key (known: "),
])
def test_a_mistyped_spec_key_gets_a_suggestion(tmp_path, table, key, hint):
    text = (ROOT / "playbooks" / "local-2site.toml").read_text()
    spec = tmp_path / "s.toml"
    spec.write_text(text.replace(f"[{table}]\n", f"[{table}]\n{key} = 1\n", 1))
    r = invoke("spec", "check", str(spec))
    assert r.exit_code == EXIT_BAD_INPUT
    assert r.stderr.startswith("error: ") and hint in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_status_shows_the_columns_watch_and_report_show():
    from dilococtl.columns import SITE_COLUMNS
    from dilococtl.store import Store
    from tests.tui.fixtures import make_run, ppl_at

    home = Path(os.environ["DILOCOCTL_HOME"])
    with Store.open(home / "state.db") as store:
        run = make_run(store, state="finished", rounds=10)
    loss = math.log(ppl_at(10)) + 0.05  # the fixture's train loss of round 10
    r = CliRunner().invoke(app, ["status", run.id], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    header = next(ln for ln in r.stdout.splitlines() if "site" in ln and "state" in ln)
    assert [c.strip() for c in header.strip("┃ ").split("┃")] == [c.name for c in SITE_COLUMNS]
    row = next(ln for ln in r.stdout.splitlines() if "site-a" in ln)
    # staleness, WAN rate, tokens/s and train loss, which the store has; no MFU without a known peak
    assert [c.strip() for c in row.strip("│ ").split("│")][4:12] == ["2/2", "87.5%", "0", "1.50", "666.67kB/s",
                                                                   "40.00k", "-", f"{loss:.3f}"]
    site = json.loads(invoke("status", run.id, "--json").stdout)["sites"][0]
    assert site["wan_bps"] == pytest.approx(1_000_000 / 1.5) and site["train_loss"] == pytest.approx(loss)


def test_every_listed_command_resolves_to_the_help_the_table_gives():
    """Issue 42: `dilococtl --help` draws `cli.COMMANDS` without importing the command modules, so
    the table must name every command a module registers, with its docstring's first line."""
    from dilococtl.cli import COMMANDS

    root = typer.main.get_command(app)
    ctx = typer.Context(root)
    for name, (_module, line) in COMMANDS.items():
        cmd = root.get_command(ctx, name)
        assert cmd is not None and cmd.name == name, name
        assert " ".join((cmd.help or "").split("\n\n")[0].split()) == line, name
    assert set(root.commands) == set(COMMANDS)  # no module registers a command the table lacks
    r = invoke("--help")
    listed = [ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("│ ") and ln.split()[1] in COMMANDS]
    assert listed == list(COMMANDS)


def test_help_imports_no_command_module():
    """Issue 42: every command module loaded at start (1.3x a bare typer app's `--help`)."""
    code = ("import sys; from dilococtl.cli import main; sys.argv[0] = 'dilococtl'; sys.argv[1:] = ['--help']\n"
            "try: main()\nexcept SystemExit: pass\n"
            "print(sorted(m for m in sys.modules if m.startswith('dilococtl.cli.')), file=sys.stderr)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "tune-h" in res.stdout and "metrics" in res.stdout
    assert res.stderr.strip() == "[]", res.stderr


def test_help_imports_neither_the_spec_nor_the_sync_model():
    """Issue 42: `tune-h`'s defaults pulled tune-h's measuring and model (spec, trainer.rules.config: ~0.1 s
    of the 0.3 s `dilococtl --help` took) into every start; they live in dilococtl.tune.defaults."""
    code = ("import sys; from dilococtl.cli import app; from typer.testing import CliRunner; "
            "r = CliRunner().invoke(app, ['--help']); assert 'tune-h' in r.output; "
            "print(sorted(m for m in sys.modules if m in ('dilococtl.tune.measure', 'dilococtl.tune.model', 'dilococtl.tune.choose', "
            "'dilococtl.spec', 'trainer.rules.config')))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
    r = invoke("tune-h", "--help")
    assert "0.1" in r.stdout and "1000" in r.stdout and "29580" in r.stdout  # the defaults still shown
