"""`dilococtl lab ...`: an emulated multi-datacenter WAN on this host (root, network namespaces)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from dilococtl.cli import app
from dilococtl.cli._common import JsonOpt, emit_json, playbook_path, print_table, progress

lab_app = typer.Typer(name="lab", no_args_is_help=True, help=(
    "An emulated multi-site WAN on this host: one network namespace + sshd per node, "
    "tbf rates and a user-space delay between sites. Needs root."))
app.add_typer(lab_app, name="lab")


@lab_app.command("up")
def up_cmd(
    sites: Annotated[int, typer.Option("--sites", help="Number of sites (datacenters).")] = 2,
    nodes_per_site: Annotated[int, typer.Option("--nodes-per-site", help="Nodes in each site.")] = 1,
    rate: Annotated[str, typer.Option("--rate", help="Rate of every inter-site link, each direction.")] = "50mbit",
    rtt: Annotated[str, typer.Option("--rtt", help="Round-trip time between any two sites.")] = "80ms",
    link: Annotated[list[str] | None, typer.Option(
        "--link", help="Override one link: A-B=RATE\\[/RTT] (both ways) or A>B=RATE\\[/RTT] (one way).")] = None,
    tcp_buffer: Annotated[str, typer.Option(
        "--tcp-buffer", help="Cap the nodes' TCP socket buffers (e.g. 128k): each connection is then limited "
        "to buffer/RTT, as on a WAN whose bandwidth-delay product exceeds the hosts' buffers.")] = "",
    cpus_per_node: Annotated[float, typer.Option(
        "--cpus-per-node", help="Cap each node at this many cores (a cgroup CPU quota; 0: no cap), so a site "
        "computes as fast alone as beside the others, as on its own hardware.")] = 0.0,
    spec_out: Annotated[Path | None, typer.Option("--spec-out", help="Write a run spec for the lab here.")] = None,
    python: Annotated[str | None, typer.Option(
        "--python", help="Interpreter the nodes run (default: this one; nodes share this filesystem).")] = None,
    slurm: Annotated[list[str] | None, typer.Option(
        "--slurm", help="Make SITE a Slurm cluster: slurmctld on its first node (the login node), slurmd on "
        "every node (Debian's slurm-wlm and munge). Repeat for several sites.")] = None,
    object_store: Annotated[bool, typer.Option(
        "--object-store", help="Run one SeaweedFS S3 store per site, in the lab, for durable checkpoints: the "
        "spec gets each site's store; `. ~/.dilococtl/lab/s3.env` puts the lab's keys in your shell.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Create the lab: namespaces, bridges, shaped links, the delayer, one sshd per node.

    Example: dilococtl lab up --sites 3 --rate 50mbit --rtt 80ms --spec-out lab.toml
    """
    from dilococtl.lab import ops

    if slurm:
        from dilococtl.lab import slurm as lab_slurm

        lab_slurm.require_slurm()
    state = ops.up(sites=sites, nodes_per_site=nodes_per_site, rate=rate, rtt=rtt, links=link or [],
                   python=python or sys.executable, tcp_buffer=tcp_buffer, cpus_per_node=cpus_per_node,
                   spec_out=spec_out, say=progress)
    st = ops.status(state)
    if slurm:
        try:
            for site in slurm:
                progress(f"slurm: {site} (slurmctld, slurmd per node, munge)")
                lab_slurm.up(state, site)
        except BaseException:
            progress("lab up failed: removing what was built")
            ops.teardown(state)
            raise
        if spec_out is not None:
            lab_slurm.rewrite_spec(spec_out, lab_slurm.load())
        st["slurm"] = lab_slurm.status()
    if object_store:
        _object_stores(state, spec_out, st)
    _show(st, json_out)


def _object_stores(state, spec_out: Path | None, st: dict) -> None:
    """`lab up --object-store`: one S3 store per site (dilococtl.lab.object_store); the lab goes if they fail."""
    from dilococtl.lab import object_store, ops

    try:
        stores = object_store.up(state, say=progress)
    except BaseException:
        progress("lab up failed: removing what was built")
        ops.teardown(state)
        raise
    if spec_out is not None:
        object_store.rewrite_spec(spec_out, stores)
    st["object_store"] = object_store.status()
    progress(f"the stores' S3 keys: `. {object_store.env_file()}` (0600) puts them in your shell for launch")


@lab_app.command("status")
def status_cmd(json_out: JsonOpt = False) -> None:
    """Nodes (sshd alive), links (configured and tbf counters) and the delayer.

    Example: dilococtl lab status --json
    """
    from dilococtl.lab import model, object_store, ops

    st = ops.status(model.require())
    if object_store.load():
        st["object_store"] = object_store.status()
    from dilococtl.lab import slurm as lab_slurm

    if lab_slurm.load():  # `lab up --slurm` sites: their daemons alive or not
        st["slurm"] = lab_slurm.status()
    _show(st, json_out)


@lab_app.command("shape")
def shape_cmd(
    link: Annotated[str, typer.Argument(help="A-B (both ways) or A>B (one way).", show_default=False)],
    shape: Annotated[str, typer.Argument(help="RATE\\[/RTT], e.g. 20mbit/120ms.", show_default=False)],
    json_out: JsonOpt = False,
) -> None:
    """Change a link while a run is going (tbf changed in place, delay updated live).

    Example: dilococtl lab shape site0-site1 10mbit/120ms
    """
    from dilococtl.lab import model, ops

    keys = ops.shape(model.parse_link(f"{link}={shape}"))
    _done(json_out, f"shaped {', '.join(keys)}: {shape}", links=keys, shape=shape)


@lab_app.command("cut")
def cut_cmd(site: Annotated[str, typer.Argument(help="Site name or index.", show_default=False)],
            json_out: JsonOpt = False) -> None:
    """Drop all traffic between SITE and the other sites (the operator still reaches it).

    Example: dilococtl lab cut site1
    """
    from dilococtl.lab import ops

    changed = ops.cut(site)
    _done(json_out, f"cut {site}" if changed else f"{site} was already cut", site=site, changed=changed)


@lab_app.command("heal")
def heal_cmd(site: Annotated[str, typer.Argument(help="Site name or index.", show_default=False)],
             json_out: JsonOpt = False) -> None:
    """Restore SITE's links after `lab cut`.

    Example: dilococtl lab heal site1
    """
    from dilococtl.lab import ops

    changed = ops.heal(site)
    _done(json_out, f"healed {site}" if changed else f"{site} was not cut", site=site, changed=changed)


@lab_app.command("kill")
def kill_cmd(
    target: Annotated[str, typer.Argument(help="Node name or site name.", show_default=False)],
    grace: Annotated[float, typer.Option("--grace", help="Seconds between SIGTERM and SIGKILL.")] = 10.0,
    json_out: JsonOpt = False,
) -> None:
    """A spot preemption: SIGTERM every process of the node(s) except sshd, SIGKILL after --grace.

    Example: dilococtl lab kill site1 --grace 5
    """
    from dilococtl.lab import ops

    pids = ops.kill(target, grace)
    _done(json_out, f"{target}: signalled {len(pids)} process(es)" + (f" ({', '.join(map(str, pids))})" if pids else ""),
          target=target, pids=pids)


@lab_app.command("chaos")
def chaos_cmd(
    scenario: Annotated[Path, typer.Argument(
        metavar="SCENARIO", help="Faults to replay (TOML, one \\[\\[fault]] table each).", show_default=False,
        callback=playbook_path)],
    run: Annotated[str | None, typer.Option(
        "--run", help="Run id, id prefix or name (default: the newest running run of this home).")] = None,
    seed: Annotated[int | None, typer.Option(
        "--seed", help="Seed of the scenario's jitter (same seed, same schedule; default: drawn and printed).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check the scenario and print its schedule only.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Replay a scenario of faults (kill, cut, degrade, loss, flap, slow) against a running lab run.

    Times are from the run's start; each fault and its restore land in the run's events.
    Ctrl-C or SIGTERM restores every link and process first (exit 130 / 143).

    Example: dilococtl lab chaos playbooks/chaos-standard.toml --seed 1
    """
    import signal

    from dilococtl.lab import chaos, model, netns
    from dilococtl.lab import scenario as scenario_mod
    from dilococtl.paths import db_path
    from dilococtl.store import Store

    netns.require_root()
    state = model.require()
    sc = scenario_mod.load(scenario, state)
    schedule = scenario_mod.plan(sc, seed)
    if dry_run:
        if json_out:
            emit_json({"scenario": str(scenario), "seed": schedule.seed, "jitter_s": schedule.jitter_s,
                       "faults": schedule.to_json()})
            return
        print(f"seed {schedule.seed}" + (f", jitter {scenario_mod.fmt_s(schedule.jitter_s)}" if schedule.jitter_s else ""))
        print_table(f"{scenario}: {len(schedule.items)} faults", ["#", "at", "kind", "target", "what"],
                    [[x["index"], scenario_mod.fmt_s(x["planned_at"]), x["kind"], x["target"], x["what"]]
                     for x in schedule.to_json()])
        return
    with Store.open(db_path()) as store:
        picked = chaos.choose_run(store, run, state, progress)
        chaos.check_kills(sc, picked, store, state)
    outcomes, signum = chaos.execute(schedule, run=picked, state=state, store_path=db_path(), say=progress)
    if json_out:
        emit_json({"run": picked.id, "seed": schedule.seed, "jitter_s": schedule.jitter_s, "start": picked.created,
                   "interrupted": signal.Signals(signum).name if signum else None,
                   "faults": [o.to_json() for o in outcomes]})
    else:
        print_table(f"chaos on run {picked.id} (seed {schedule.seed}), seconds from its start",
                    ["#", "kind", "target", "planned", "applied", "ended"],
                    [[o.index, o.kind, o.target, f"{o.planned_at:.1f}",
                      "-" if o.applied_at is None else f"{o.applied_at:.1f}",
                      "-" if o.ended_at is None else f"{o.ended_at:.1f}"] for o in outcomes])
    if signum:
        progress(f"chaos stopped by {signal.Signals(signum).name}: every link and process it changed is restored")
        raise typer.Exit(128 + signum)


@lab_app.command("down")
def down_cmd(
    all_labs: Annotated[bool, typer.Option("--all", help="Also remove labs other homes still own.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Remove the lab and any leftovers of crashed labs (idempotent).

    Example: dilococtl lab down
    """
    from dilococtl.lab import netns, object_store, ops

    netns.require_root()
    stores = object_store.stop()  # before ops.down removes their files
    removed = ops.down(all_labs=all_labs, say=progress)
    removed += [f"{stores} object stores"] if stores else []
    _done(json_out, "removed: " + "; ".join(removed) if removed else "no lab to remove", removed=removed)


def _done(json_out: bool, line: str, **fields) -> None:
    """What a lab change did: one line, or one JSON object with `fields`."""
    if json_out:
        emit_json(fields)
    else:
        print(line)


def _show(st: dict, json_out: bool) -> None:
    if json_out:
        emit_json(st)
        return
    print_table(f"lab {st['id']} ({st['status']}, {st['block']})", ["node", "site", "address", "sshd"],
                [[n["name"], n["site"], n["address"], "up" if n["sshd_alive"] else "DOWN"] for n in st["nodes"]])
    rows = []
    for link in st["links"]:
        m = link["measured"]
        rows.append([link["link"], link["rate"], f"{link['delay_ms']:g}ms", "CUT" if link["cut"] else "",
                     m.get("bytes", ""), m.get("drops", "")])
    print_table(None, ["link", "rate", "one-way delay", "cut", "bytes sent", "tbf drops"], rows)
    d = st["delayer"]
    print(f"delayer pid {d['pid']} {'alive' if d['alive'] else 'DEAD'}: queued {d.get('queued')}, "
          f"held {d.get('held')}, overflows {d.get('overflows')}")
    if st.get("chaos_rules"):
        print(f"lab chaos holds {len(st['chaos_rules'])} rule(s) in the core: " + "; ".join(st["chaos_rules"]))
    if st.get("tcp_buffer"):
        print(f"nodes' TCP buffers capped at {st['tcp_buffer'] // 1024} KiB")
    for site, c in st.get("object_store", {}).items():
        print(f"object store {site}: {c['endpoint']} bucket {c['bucket']} {'up' if c['alive'] else 'DOWN'}")
    for site, c in st.get("slurm", {}).items():
        print(f"slurm {site}: login {c['login']}, partition {c['partition']} ({len(c['nodes'])} nodes, "
              f"{c['gpus_per_node']} GPUs each, MaxTime {c['max_time']}), accounts {', '.join(c['accounts'])}, "
              f"QoS {', '.join(c['qos'])}")
