"""`dilococtl report`: the dashboard's curves as PNG files (matplotlib) and a Markdown summary, and the
goodput ledger's lost time by cause per round (dilococtl.goodput) as a plot and as JSON.

Plots are drawn from the same bucketed series as the dashboard (dilococtl.queries), with more
points (REPORT_POINTS per site), so a run of any length reports in about the same time.
matplotlib is imported here only, through its object API (Figure + Agg), never pyplot: no GUI
backend, no global state.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections import Counter
from pathlib import Path

from dilococtl import columns, fmt, goodput, metrics, queries
from dilococtl.errors import BadInput
from dilococtl.store import Store

REPORT_POINTS = 2000  # buckets per site in the plots
DPI = 110
FIGSIZE = (8.0, 4.5)  # inches
LINESTYLES = ("-", "--", ":", "-.")  # sites often share one curve (synced parameters): keep each visible

PLOT_FILES = ("perplexity_vs_tokens.png", "efficiency_per_round.png", "sync_seconds_per_round.png",
              "lost_time_per_round.png")
GOODPUT_FILE = "goodput.json"  # the lost-time plot's figures (and `report --json`'s "goodput")
SUMMARY_FILE = "summary.md"
LOST_BARS = 100  # at most this many bars in the lost-time plot: a longer run sums rounds per bar
CAUSE_COLORS = {"exchange": "tab:blue", "straggler": "tab:orange", "failure_detection": "tab:red",
                "restart": "tab:purple", "discarded": "tab:brown", "other": "tab:gray"}  # goodput.CAUSES


def write_report(store: Store, run_id: str, out_dir: str | Path) -> list[Path]:
    """Write the plots (when the run has rounds) and summary.md into `out_dir`; returns the paths."""
    run = store.get_run(run_id)
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadInput(f"cannot create report directory {out}: {e.strerror or e}") from None
    series = queries.series(store, run.id, max_points=REPORT_POINTS)
    files: list[Path] = []
    led = None
    if not series.empty:
        last = max(b.round for buckets in series.sites.values() for b in buckets)
        led = goodput.ledger(run, store, bucket=max(1, math.ceil(last / LOST_BARS)))
        files += _plots(series, out, title=f"{run.name} {run.id}")
        files.append(_save(lost_figure(led, title=f"{run.name} {run.id}"), out / PLOT_FILES[3]))
        files.append(_write_json(goodput_json(led), out / GOODPUT_FILE))
    files.append(_summary(store, run.id, series, out, plots=[f.name for f in files if f.suffix == ".png"],
                          ledger=led))
    return files


def goodput_json(led: goodput.Ledger) -> dict:
    """The lost-time plot's figures: the run's goodput and lost seconds, and per bar (a round, or
    `bucket_rounds` rounds from `round`) the sites' useful and lost seconds."""
    return {**{k: v for k, v in led.to_json().items() if k != "goodput_sites"},
            "useful_s": sum(s.useful_s for s in led.sites), "wall_s": sum(s.wall_s for s in led.sites),
            "bucket_rounds": led.rounds[0].rounds if led.rounds else 1, "rounds": [r.to_json() for r in led.rounds]}


def report_json(files: list[Path]) -> dict:
    """What `report --json` adds to the paths: the lost-time figures, read back from goodput.json."""
    path = next((f for f in files if f.name == GOODPUT_FILE), None)
    return {"goodput": json.loads(path.read_text()) if path is not None else None}


def _write_json(obj: dict, path: Path) -> Path:
    path.write_text(json.dumps(obj, indent=1) + "\n")
    return path


def _figure():
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    return fig, fig.add_subplot()


def _plots(series: queries.Series, out: Path, *, title: str) -> list[Path]:
    return [_save(perplexity_figure(series, title=title), out / PLOT_FILES[0]),
            _save(round_figure(series, "efficiency", title=title), out / PLOT_FILES[1]),
            _save(round_figure(series, "sync", title=title), out / PLOT_FILES[2])]


def round_figure(series: queries.Series, what: str, *, title: str):
    """Per site and round: `what` "efficiency" (%, with each site's whole-run figure, the summary's
    eff cell, as a dashed line: a dip is one round's, the summary sums them all) or "sync" (seconds)."""
    per = "" if series.bucket_rounds == 1 else f" (mean of {series.bucket_rounds} rounds)"
    label, value = {"efficiency": ("compute efficiency %", lambda b: (b.efficiency or 0.0) * 100),
                    "sync": ("sync seconds per round", lambda b: b.mean_sync_s)}[what]
    fig, ax = _figure()
    for site, buckets in series.sites.items():
        if buckets:
            (line,) = ax.plot([b.round for b in buckets], [value(b) for b in buckets], label=site, linewidth=1.2)
            eff = metrics.efficiency(sum(b.compute_s for b in buckets), sum(b.sync_s for b in buckets))
            if what == "efficiency" and eff is not None:
                ax.axhline(eff * 100, color=line.get_color(), linestyle="--", linewidth=1,
                           label=f"{site} whole run {fmt.pct(eff)}")
    ax.set(title=f"{title}: {label}{per}", xlabel="outer round", ylabel=label)
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def lost_figure(led: goodput.Ledger, *, title: str):
    """Lost seconds by cause per round (or per bar of rounds), summed over the sites, stacked one colour
    per cause, each labelled with its run total; the run's goodput in the title (dilococtl.goodput)."""
    fig, ax = _figure()
    rounds = led.rounds
    xs = [r.round + (r.rounds - 1) / 2 for r in rounds]
    width = 0.8 * (rounds[0].rounds if rounds else 1)
    bottom = [0.0] * len(rounds)
    totals = led.lost_s
    for cause in goodput.CAUSES:
        heights = [r.lost_s[cause] for r in rounds]
        if any(heights):  # a cause that lost nothing stays out of the legend
            ax.bar(xs, heights, width, bottom=bottom, color=CAUSE_COLORS[cause], label=f"{cause} {totals[cause]:.1f} s")
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    per = f" (sums of {rounds[0].rounds} rounds)" if rounds and rounds[0].rounds > 1 else ""
    ax.set(title=f"{title}: lost time by cause per round, goodput {fmt.pct(led.goodput)}",
           xlabel=f"outer round{per}", ylabel="seconds lost (all sites)")
    ax.grid(alpha=0.3, axis="y")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    return fig


def perplexity_figure(series: queries.Series, *, title: str):
    """Validation perplexity on a log scale (a falling curve stays readable to its end) against one
    token axis, the tokens of all sites, for the sites and the global curve alike (a site's own
    tokens would draw equal perplexities as two curves); the final global value is labelled."""
    fig, ax = _figure()
    for i, (site, buckets) in enumerate(series.sites.items()):
        pts = [(series.tokens_of_all(b), b.val_ppl) for b in buckets if b.val_ppl is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), label=site, linewidth=1.2, alpha=0.8,
                    linestyle=LINESTYLES[i % len(LINESTYLES)])
    gpts = [(x, y) for x, y in zip(series.global_tokens, series.global_ppl, strict=True) if y is not None]
    if gpts:
        ax.plot(*zip(*gpts, strict=True), label="global", color="black", linewidth=2)
        x, y = gpts[-1]
        ax.annotate(f"{y:.2f}", (x, y), xytext=(-4, 8), textcoords="offset points", ha="right",
                    fontweight="bold")
    ax.set(title=f"{title}: validation perplexity", xlabel="tokens (all sites)",
           ylabel="validation perplexity (log scale)")
    if ax.get_lines():  # a log axis of nothing warns
        ax.set_yscale("log")
        from matplotlib.ticker import LogFormatter  # labels on the minor ticks too: a short range still reads

        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.4)))
    ax.grid(alpha=0.3, which="both")
    if ax.get_legend_handles_labels()[0]:  # no round evaluated yet: an empty plot, no legend
        ax.legend()
    return fig


def _save(fig, path: Path) -> Path:
    fig.savefig(path)
    return path


REPLAY_ROUNDS = 20  # the newest rounds the summary holds against tune-h's model


def _replay_lines(store: Store, run) -> list[str]:
    """The newest rounds against tune-h's model replayed from the sites' arrivals (dilococtl.tune)."""
    from dilococtl.tune.history import rounds_against_model

    rows = rounds_against_model(store, run, last=REPLAY_ROUNDS)
    if not rows:
        return []
    lines = ["", "## The exchange against tune-h's model", "",
             "Each round as the site that waited least measured it, against the round replayed from when "
             "every site entered it (seconds; quorum / weight all-gather / payload).", "",
             "| round | site | measured | replayed | ratio | measured parts | replayed parts |",
             "| ---: | --- | ---: | ---: | ---: | --- | --- |"]
    for g in rows:
        m, p = g["measured"], g["predicted"]
        parts = ("quorum_s", "weight_s", "payload_s")
        lines.append(f"| {g['round']} | {g['site']} | {g['sync_s']:.3f} | {g['predicted_s']:.3f} | "
                     f"{g['sync_s'] / g['predicted_s']:.2f}x | {' / '.join(f'{m[k]:.3f}' for k in parts)} | "
                     f"{' / '.join(f'{p[k]:.3f}' for k in parts)} |")
    return lines


def _summary(store: Store, run_id: str, series: queries.Series, out: Path, *, plots: list[str],
             ledger: goodput.Ledger | None = None) -> Path:
    run = store.get_run(run_id)
    spec = run.spec()
    stats = queries.site_stats(store, run.id, series)
    figures = metrics.run_metrics(run, series.round_time, stats)
    done = max((s.round for s in stats), default=0)
    end = run.finished or time.time()
    gppl = [p for p in series.global_ppl if p is not None]
    kinds = Counter(e.event for e in store.events(run.id))
    lines = [
        f"# Run {run.name} ({run.id})",
        "",
        f"- state: **{run.state}**" + (f" ({run.exit_reason})" if run.exit_reason else ""),
        f"- spec: `{run.spec_path}`; mode {spec.diloco.mode}, H {spec.diloco.h}, "
        f"compression {spec.diloco.compression}, {len(stats)} site(s)",
        f"- rounds: {done} of {spec.diloco.rounds}",
        f"- launched {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(run.created))}, "
        f"{'ran' if run.finished else 'running for'} {fmt.duration(end - run.created)}",
    ]
    if figures.sync_share is not None:
        lines.append(f"- sync share of round time (compute + sync): {fmt.pct(figures.sync_share)} "
                     f"({figures.sync_s:.1f} s of {figures.round_s:.1f} s, summed over the sites' rounds; "
                     f"{figures.rounds} rounds); "
                     f"of wall time: {fmt.pct(figures.sync_share_of_wall)} ({fmt.duration(figures.wall_s)})")
    if gppl:
        lines.append(f"- validation perplexity (global): {gppl[0]:.3f} at the start, {gppl[-1]:.3f} at the end, "
                     f"best {min(gppl):.3f}")
    # the columns of status and watch, by the same names (dilococtl/columns.py), and the bytes received
    names = [c.name for c in columns.SITE_COLUMNS] + ["MB received"]
    lines += ["", "## Sites", "", "| " + " | ".join(names) + " |",
              "| --- | --- |" + " ---: |" * (len(names) - 2)]
    for s in stats:
        cells = columns.text_cells(dataclasses.asdict(s))
        lines.append("| " + " | ".join([cells[c.key] for c in columns.SITE_COLUMNS]
                                       + [f"{s.bytes_recv / 1e6:.1f}"]) + " |")
    if ledger is not None and ledger.goodput is not None:
        lost = ledger.lost_s
        lines += ["", "## Goodput", "",
                  f"{fmt.pct(ledger.goodput)} of the sites' wall time reached θ "
                  f"({sum(s.useful_s for s in ledger.sites):.1f} s of {sum(s.wall_s for s in ledger.sites):.1f} s); "
                  "lost, by cause (per round: lost_time_per_round.png, goodput.json):", "",
                  "| " + " | ".join(goodput.CAUSES) + " |", "|" + " ---: |" * len(goodput.CAUSES),
                  "| " + " | ".join(f"{lost[c]:.1f}" for c in goodput.CAUSES) + " |"]
    lines += _replay_lines(store, run)
    lines += ["", "## Events", ""]
    lines += [f"- {k}: {n}" for k, n in sorted(kinds.items())] or ["- none"]
    lines += ["", "## Plots", ""]
    if plots:
        lines += [f"![{p}]({p})" for p in plots]
    else:
        lines.append("No rounds recorded: nothing to plot.")
    if series.bucket_rounds > 1:
        lines += ["", f"Plotted points are means over {series.bucket_rounds} rounds."]
    path = out / SUMMARY_FILE
    path.write_text("\n".join(lines) + "\n")
    return path
