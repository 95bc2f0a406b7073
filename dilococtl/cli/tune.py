"""`dilococtl tune-h SPEC`: measure the WAN links and the step time, choose H under a sync budget."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from dilococtl.cli import app
from dilococtl.cli._common import AcceptNewOpt, JsonOpt, SpecArg, console, emit_json, print_table, progress
from dilococtl.errors import EXIT_FAILED
from dilococtl.tune.defaults import DEFAULT_BUDGET, DEFAULT_MAX_H, DEFAULT_PORT, FEW_ROUNDS


@app.command("tune-h")
def tune_h(
    spec_path: SpecArg,
    budget: Annotated[float, typer.Option("--budget", help="Allowed sync time as a fraction of compute, in (0, 1).")]
    = DEFAULT_BUDGET,
    max_h: Annotated[int, typer.Option("--max-h", help="Largest acceptable H.")] = DEFAULT_MAX_H,
    duration: Annotated[float, typer.Option("--duration", help="Measured seconds per link direction.")] = 5.0,
    warmup: Annotated[float, typer.Option(
        "--warmup", help="Least seconds sent before measuring (at least 20 RTTs are used).")] = 1.0,
    streams: Annotated[int, typer.Option(
        "--streams", help="Parallel TCP streams per direction (0: as many as the run's exchange opens).")] = 0,
    port: Annotated[int, typer.Option("--port", help="TCP port of the link probe on the site leaders.")]
    = DEFAULT_PORT,
    step_source: Annotated[str, typer.Option(
        "--step-source", help="auto (an earlier run of the same config, else a benchmark), bench or records.")]
    = "auto",
    write: Annotated[bool, typer.Option("--write", help="Write the chosen H into the spec (comments kept).")]
    = False,
    accept_new: AcceptNewOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Measure links between site leaders and the inner step time; choose H so sync <= budget x compute.

    Example: dilococtl tune-h lab.toml --budget 0.1 --write
    """
    from dilococtl.spec import load_spec
    from dilococtl.spec_sites import refuse_slurm_sites
    from dilococtl.store import Store
    from dilococtl.tune import tune_h as tune_cmd  # an attribute, so tests can stand in for the measuring
    from dilococtl.tune.choose import check_limits
    from dilococtl.tune.measure import ProbeSettings

    check_limits(budget, max_h)
    settings = ProbeSettings(port=port, streams=streams, duration_s=duration, warmup_s=warmup)
    settings.check()
    spec = load_spec(spec_path)
    refuse_slurm_sites(spec, "tune-h")
    with Store.open() as store:
        res = tune_cmd.tune(spec, store=store, budget=budget, max_h=max_h, settings=settings,
                            step_source=step_source, write=write, accept_new=accept_new, say=progress)
    if json_out:
        emit_json(res.to_json())
    else:
        _show(res)
    from dilococtl.spec_summary import store_note

    if store_note(spec):  # uploads that compete with the exchange on the links just measured
        progress(f"note: {store_note(spec)}")
    if not res.choice.within_max:
        # exit 1 says why, in one line on stderr, with --json too (stdout keeps the document)
        print(f"error: {over_max_h(res)}", file=sys.stderr)
        raise SystemExit(EXIT_FAILED)


def over_max_h(res) -> str:
    """Why no H fits: the budget that cannot be met below --max-h, and what would meet it."""
    c = res.choice
    if c.codec_cap is not None and c.h <= res.max_h:
        return (f"sync budget {res.budget:g} of compute cannot be met at H <= {c.codec_cap}, the most {res.codec} "
                f"keeps its quality at (past it most of a round's progress waits in its residual; BENCHMARKS.md): "
                f"at H = {c.h} sync takes {c.sync_share:.0%} of the time; set diloco.mode = \"overlap\" to hide the "
                f"exchange behind compute, or take a denser codec")
    msg = (f"sync budget {res.budget:g} of compute cannot be met below H = {res.max_h} (--max-h): "
           f"it needs H = {c.h}; raise --max-h to {c.h}")
    if res.suggestion:
        s = res.suggestion
        return msg + f", or set diloco.compression = \"{s['compression']}\" (H = {s['h']}, " \
                     f"{s['efficiency'] * 100:.1f}% efficiency)"
    return msg + ", or allow a larger --budget (no compression setting tried brings H under the maximum)"


def _show(res) -> None:
    print_table("links (measured at the receiver)", ["link", "hosts", "streams", "Mbit/s", "RTT ms", "retrans"],
                [[f"{x.src} -> {x.dst}", f"{x.src_host} -> {x.dst_host}", x.streams, f"{x.mbit:.1f}",
                  f"{x.rtt_ms:.1f}", f"{x.retrans}/{x.segs_out}"] for x in res.links])
    out = console(stderr=False)
    steps = res.steps["per_site"]
    out.print("step time (" + res.steps["source"] + "): "
              + ", ".join(f"{s} {v * 1000:.1f} ms" for s, v in steps.items()))
    c = res.choice
    out.print(f"payload {res.payload_bytes:,} bytes/round per process ({res.codec}, "
              f"{' + '.join(op for op, _ in res.phases)}), sent {res.replicas}x per site; "
              f"mode {res.mode}: predicted sync {c.sync_s:.3f} s/round")
    for line in res.exchange_lines():  # fragments: each exchange; the bandwidth the spec's H needs
        out.print(line)
    if len(set(round(v, 3) for v in c.last_site.values())) > 1:
        out.print("the round as the site that arrives last waits it (its quorum RPC to the Lighthouse): "
                  + ", ".join(f"{s} {v:.3f} s" for s, v in c.last_site.items()))
    if res.transport == "tls":
        how = ("derived from the links: the fewest streams carrying 90% of each link; written with --write"
               if res.streams_derived else "diloco.transport_streams")
        out.print(f"transport tls: {res.streams} stream(s) per peer and direction ({how})")
        if res.link_pace:
            how = ("derived: each link's goodput, where a round moves several bandwidth-delay products over it; "
                   "written with --write" if res.pace_derived else "diloco.transport_link_pace_mbit")
            rest = f"; other links at {res.pace_mbit:g}" if res.pace_mbit else "; other links unpaced"
            out.print("pacing, Mbit/s in all per process: " + ", ".join(
                f"{k} {v:g}" for k, v in res.link_pace.items()) + f"{rest} ({how})")
        elif res.pace_mbit:
            out.print(f"pacing: the streams to a peer at {res.pace_mbit:g} Mbit/s in all (diloco.transport_pace_mbit)")
    restarting = sorted({x.src_host for x in res.links if x.restarts_idle})
    if restarting:
        extra = c.breakdown.get("restart_s")
        cost = f" (+{extra:.3f} s/round predicted)" if extra else ""
        out.print(f"note: TCP on {', '.join(restarting)} restarts idle connections in slow start{cost}, and a "
                  "loss in one ramp makes the later ones slower still (lab: 1.6x); "
                  "`sysctl -w net.ipv4.tcp_slow_start_after_idle=0` on the nodes keeps the window between rounds")
    hidden = res.mode != "sync"
    print_table(f"predicted efficiency (budget {res.budget:g})",
                ["H", "compute s", "efficiency", "sync share"] + (["lands at"] if hidden else []),
                [[r["h"], f"{r['h'] * c.step_s:.2f}", f"{r['efficiency'] * 100:.1f}%", f"{r['sync_share'] * 100:.1f}%"]
                 + ([f"{r['land'] * 100:.1f}%"] if hidden else []) for r in res.table])
    if c.within_max:
        note = " (written to the spec)" if res.written else ""
        out.print(f"H = {c.h}{note}: predicted efficiency {c.efficiency * 100:.1f}% (spec has H = {res.current_h})")
        if c.codec_cap is not None:
            out.print(f"note: H stops at {c.codec_cap}, the most {res.codec} keeps its quality at (a longer round "
                      "would spend less of it on sync, but most of its progress would wait in the codec's residual)")
        if res.lands:
            out.print("overlap and async land the update as soon as the exchange is done (launch applies it): "
                      + ", ".join(f"{m} {round(f * c.h)} of {c.h} steps" for m, f in res.lands.items())
                      + " into the next round")
        if res.rounds < FEW_ROUNDS:
            longer = "train.steps" if res.sized_in_steps else "diloco.rounds"
            out.print(f"note: at H = {c.h} the run has {res.rounds} outer round(s): the sites average too seldom to "
                      f"train as one cluster would (at least {FEW_ROUNDS}: raise {longer}, or pick a codec that "
                      "lowers H; BENCHMARKS.md, quality of every sync mode)")
