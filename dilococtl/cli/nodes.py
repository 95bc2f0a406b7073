"""Node commands: `doctor` (can every node run this spec) and `provision` (install the trainer)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dilococtl.cli import app
from dilococtl.cli._common import AcceptNewOpt, JsonOpt, SpecArg, console, emit_json, print_table, progress

WheelhouseOpt = Annotated[Path | None, typer.Option(
    "--wheelhouse", help="Directory of wheels (torch, torchft, ...) to install from on air-gapped nodes.")]

_STYLE = {"ok": "green", "warn": "yellow", "fail": "red", "installed": "green", "up to date": "green",
          "verified": "green", "failed": "red", "unreachable": "red"}


def _mark(status: str, text: str) -> str:
    from rich.markup import escape

    return f"[{_STYLE.get(status, 'white')}]{escape(text)}[/]"


def _exit(code: int) -> None:
    # SystemExit, not typer.Exit: the latter's code is returned (and lost) under standalone_mode=False.
    if code:
        raise SystemExit(code)


@app.command()
def doctor(spec: SpecArg, json_: JsonOpt = False, accept_new: AcceptNewOpt = False,
           links: Annotated[bool, typer.Option(
               "--links", help="Also measure each link's bandwidth and round trip (a stream sweep, ~30-60 s per "
                               "site pair) and record them: launch derives the TLS transport's streams and pacing "
                               "from them for a spec that sets neither.")] = False) -> None:
    """Check every node of SPEC: reachable, python, torch, GPUs, disk, clock, trainer; and ports between sites.

    Exit 0 when all checks pass, 1 when one fails, 3 when a node is unreachable.

    Example: dilococtl doctor lab.toml --accept-new-host-keys
    """
    from dilococtl.doctor import run_doctor
    from dilococtl.spec import load_spec

    rs = load_spec(spec)
    report = run_doctor(rs, accept_new=accept_new, progress=None if json_ else progress, bandwidth=links)
    if report.bandwidth:
        import dataclasses

        from dilococtl.store import Store

        with Store.open() as store:
            store.add_link_probe(spec_path=str(Path(spec).resolve()), links=[dataclasses.asdict(x) for x in report.bandwidth])
    if json_:
        emit_json(report.to_json())
    else:
        names = ["python", "torch", "torchft", "gpus", "disk", "clock", "trainer"]
        if any(c.name == "shared" for n in report.nodes for c in n.checks):  # a site of several nodes
            names.append("shared")
        if any(c.name == "data" for n in report.nodes for c in n.checks):  # the run reads token shards
            names.append("data")
        if any(c.name == "ports" for n in report.nodes for c in n.checks):  # the run's fixed ports on this host
            names.append("ports")
        rows = []
        for n in report.nodes:
            by = {c.name: c for c in n.checks}
            cells = [_mark(by[k].status, by[k].short or by[k].status) if k in by else "" for k in names]
            rows.append([n.site, n.host, _mark(n.status, n.status), *cells])
        print_table("nodes", ["site", "host", "status", *names], rows)
        # the table holds the gist; what is wrong gets a whole line each
        out = console(stderr=False)
        for n in report.nodes:
            for c in n.checks:
                if c.status != "ok" and n.reachable:
                    out.print(_mark(c.status, f"{c.status}: {n.site}/{n.host} {c.name}: {c.detail}"), soft_wrap=True)
        if report.links:
            print_table("ports between sites", ["from", "to", "port", "purpose", "result"],
                        [[f"{x.src_site}/{x.src_host}", f"{x.dst_site}/{x.dst_host}", x.port, x.purpose,
                          _mark(x.status, x.detail)] for x in report.links])
        if report.bandwidth:
            print_table("bandwidth (recorded: launch derives the TLS streams and pacing from it)",
                        ["from", "to", "Mbit/s", "rtt ms", "streams: Mbit/s"],
                        [[x.src, x.dst, f"{x.mbit:.1f}", f"{x.rtt_ms:.1f}",
                          ", ".join(f"{int(n)}: {m:.1f}" for n, m in x.sweep)] for x in report.bandwidth])
        from dilococtl.doctor_store import line as store_line

        for x in report.stores:  # one line per site and checkpoint store
            out.print(_mark(x.status, store_line(x)), soft_wrap=True)
    err = console()
    for n in report.nodes:
        if not n.reachable:  # one line per unreachable node, as for any known error
            err.print(f"error: {n.checks[0].detail}", markup=False, soft_wrap=True)
    _exit(report.exit_code)


@app.command()
def provision(spec: SpecArg, wheelhouse: WheelhouseOpt = None, json_: JsonOpt = False,
              accept_new: AcceptNewOpt = False) -> None:
    """Install this dilococtl's trainer on every node of SPEC (idempotent: unchanged nodes are skipped).

    Exit 0 when every node is ready, 1 when one failed, 3 when one is unreachable.

    Example: dilococtl provision lab.toml
    """
    from dilococtl.provision import run_provision
    from dilococtl.spec import load_spec

    rs = load_spec(spec)
    report = run_provision(rs, wheelhouse=wheelhouse, accept_new=accept_new,
                           progress=None if json_ else progress)
    if json_:
        emit_json(report.to_json())
    else:
        print_table(f"provision ({Path(report.wheel).name or 'local only'})", ["site", "host", "status", "python", "detail"],
                    [[n.site, n.host, _mark(n.status, n.status), n.python, n.detail] for n in report.nodes])
    err = console()
    for n in report.nodes:
        if n.status == "unreachable":
            err.print(f"error: {n.detail}", markup=False, soft_wrap=True)
        elif n.status == "failed" and n.log_tail:
            err.print(f"--- {n.site}/{n.host}: last lines of its provision log ---", markup=False)
            err.print(n.log_tail, markup=False, soft_wrap=True)
    _exit(report.exit_code)
