"""`dilococtl spec ...`: check a run spec without starting anything."""

from __future__ import annotations

import typer

from dilococtl.cli import app
from dilococtl.cli._common import JsonOpt, SpecArg, console, emit_json, print_table

spec_app = typer.Typer(help="Check run specs (TOML).", no_args_is_help=True)
app.add_typer(spec_app, name="spec")


def _human(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


@spec_app.command("check")
def check(spec: SpecArg, json_out: JsonOpt = False) -> None:
    """Validate a run spec and print what it would run (exit 2 with one line when it is bad).

    Example: dilococtl spec check playbooks/local-2site.toml
    """
    from dilococtl.data_check import check_local
    from dilococtl.spec import load_spec
    from dilococtl.spec_summary import summary

    loaded = load_spec(spec)
    from dilococtl.sinks import check_installed

    check_installed(loaded.metrics.sinks)  # a sink's missing package: one line naming the extra, exit 2
    s = summary(loaded)  # a bad spec: one line, exit 2 (dilococtl/cli/__init__.py)
    s["notes"] = [*s["notes"], *check_local(loaded)]  # local data: doctor's checks; a failure is exit 2
    if json_out:
        emit_json(s)
        return
    print_table(f"{s['name']} ({s['path']})", ["site", "nodes", "procs/node", "gpus/node", "tp", "pp", "dp", "hosts"],
                [[x["name"], x["nodes"], x["nproc_per_node"], x["gpus_per_node"], x["tp"], x["pp"], x["dp"],
                  f"slurm via {x['login']}" if x.get("scheduler") == "slurm" else
                  ", ".join(x["hosts"]) if len(x["hosts"]) <= 3 else f"{x['hosts'][0]} ... {x['hosts'][-1]}"]
                 for x in s["sites"]])
    out = console(stderr=False)
    out.print(f"{len(s['sites'])} sites, {s['nodes']} nodes, {s['processes']} processes")
    out.print(f"model {s['preset']}: {_human(s['params'])} parameters ({s['params']:,})")
    out.print(f"{s['algorithm']} ({s['mode']}), H {s['h']}, {s['rounds']} rounds, compression {s['compression']}")
    out.print(f"{_human(s['tokens_per_round'])} tokens per round, {_human(s['tokens_total'])} in all "
              f"(data: {s['data']})")
    out.print(f"lighthouse {s['lighthouse']}")
    for line in s["notes"]:
        out.print(f"note: {line}", markup=False, highlight=False, soft_wrap=True)
    out.print("spec OK")
