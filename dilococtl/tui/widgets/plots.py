"""The curves: validation perplexity against global tokens (per site and their mean), and the focused
site's compute efficiency and sync seconds per round. A wide terminal shows the three; a narrow one
shows one at a time (`v` shows the next).

Every perplexity curve shares one x axis, the tokens of all sites together at that round: a site's
curve drawn against its own tokens would look K times as sample-efficient as it is, since every
site's parameters already hold what the others learned.

Drawn with plotext from the bucketed series, and drawn off the UI thread: `render_plots` runs in
the loader's worker (plotext is pure Python, ~10 ms a plot) and the widgets only show the finished
text, so a refresh never makes the screen wait for a plot.
"""

from __future__ import annotations

from rich.text import Text
from textual.containers import Horizontal, Vertical
from textual.widgets import Static

from dilococtl.queries import Series

SITE_COLORS = ("cyan", "magenta", "green", "orange", "blue", "red", "yellow")
PLOT_IDS = ("ppl-plot", "eff-plot", "sync-plot")


def _per(series: Series) -> str:
    return "" if series.bucket_rounds == 1 else f" (mean of {series.bucket_rounds} rounds)"


def _figure(width: int, height: int):
    from plotext._figure import _figure_class  # plotext's own object API: no global figure shared by threads

    fig = _figure_class()
    fig._limit_size(False, False)  # the widget's size, not the terminal plotext sees (80x24 when piped)
    fig.plotsize(max(width, 10), max(height, 5))
    fig.theme("clear")  # the widget's background shows through
    return fig


MAX_YTICKS = 6  # labelled rows on a plot's y axis at most


def _tick_label(v: float, step: float) -> str:
    import math

    decimals = min(3, max(0, 1 - math.floor(math.log10(step)))) if step > 0 else 1
    return f"{v:.{decimals}f}"


def build_even(fig, ys: list[float], lo: float | None = None, hi: float | None = None) -> str:
    """The figure's text with its y labels on evenly spaced rows.

    plotext spaces its tick values evenly but puts each on the nearest row, so on a short plot the
    rows between labels differ (1, 2, 1, 1, 2, ...) and a point can sit on the wrong label's row.
    Here the canvas rows are counted on a first draw, and the ticks are put on rows an equal whole
    number apart, from `lo` to `hi` (the data's range unless given)."""
    text = fig.build()
    if not ys:
        return text
    lo = min(ys) if lo is None else lo
    hi = max(ys) if hi is None else hi
    if hi <= lo:
        return text
    lines = text.splitlines()
    top = next((i for i, ln in enumerate(lines) if "┌" in ln), None)
    bottom = next((i for i, ln in enumerate(lines) if "└" in ln), None)
    if top is None or bottom is None or bottom - top < 3:
        return text
    gaps = bottom - top - 2  # rows of the canvas - 1: the first row is hi, the last lo
    every = max(2, -(-gaps // (MAX_YTICKS - 1)))  # rows between labels: at most MAX_YTICKS labels
    every = next((g for g in (every, every + 1) if gaps % g == 0), every)  # the top row labelled when it can be
    step = (hi - lo) * every / gaps
    ticks = [lo + step * j for j in range(gaps // every + 1)]
    fig.ylim(lo, hi)
    fig.yticks(ticks, [_tick_label(t, step) for t in ticks])
    return fig.build()


def global_x(series: Series) -> dict[int, int]:
    """Bucket index (round // bucket_rounds) -> tokens of all sites there (series.global_tokens)."""
    keys = sorted({(b.round - 1) // series.bucket_rounds for bs in series.sites.values() for b in bs})
    return dict(zip(keys, series.global_tokens, strict=False))


def render_ppl(series: Series, width: int, height: int) -> Text:
    fig = _figure(width, height)
    gx = global_x(series)
    for i, (site, buckets) in enumerate(series.sites.items()):
        pts = [(gx[(b.round - 1) // series.bucket_rounds], b.val_ppl) for b in buckets if b.val_ppl is not None]
        if pts:
            fig.plot([p[0] for p in pts], [p[1] for p in pts], label=site,
                     color=SITE_COLORS[i % len(SITE_COLORS)], marker="braille")
    gpts = [(x, y) for x, y in zip(series.global_tokens, series.global_ppl, strict=True) if y is not None]
    if gpts:
        fig.plot([p[0] for p in gpts], [p[1] for p in gpts], label="mean", color="white", marker="dot")
    fig.title("validation perplexity vs global tokens")
    fig.xlabel("tokens of all sites")
    ys = [b.val_ppl for bs in series.sites.values() for b in bs if b.val_ppl is not None] + [p[1] for p in gpts]
    return Text.from_ansi(build_even(fig, ys))


def render_site(series: Series, site: str, what: str, width: int, height: int) -> Text:
    """`what`: "efficiency" (compute / (compute + sync), %) or "sync" (seconds per round)."""
    fig = _figure(width, height)
    buckets = series.sites.get(site, [])
    xs = [b.round for b in buckets]
    if what == "efficiency":
        ys = [(b.efficiency or 0.0) * 100 for b in buckets]
        fig.title(f"{site}: compute efficiency %{_per(series)}")
        color = "green"
    else:
        ys = [b.mean_sync_s for b in buckets]
        fig.title(f"{site}: sync seconds per round{_per(series)}")
        color = "orange"
    if xs:
        fig.plot(xs, ys, color=color, marker="braille")
    fig.xlabel("round")
    if what == "efficiency":
        return Text.from_ansi(build_even(fig, ys, 0.0, 100.0) if xs else fig.build())
    return Text.from_ansi(build_even(fig, ys, 0.0 if ys and min(ys) >= 0 else None))


def render_plots(series: Series, site: str, sizes: dict[str, tuple[int, int]]) -> dict[str, Text]:
    """The plots on screen at their sizes ({plot id: (width, height)}); thread-safe."""
    draw = {"ppl-plot": lambda w, h: render_ppl(series, w, h),
            "eff-plot": lambda w, h: render_site(series, site, "efficiency", w, h),
            "sync-plot": lambda w, h: render_site(series, site, "sync", w, h)}
    return {pid: draw[pid](*size) for pid, size in sizes.items()}


class PlotView(Static):
    """Shows a plot rendered elsewhere."""


WIDE = 120  # columns from which the three plots are shown side by side


class Plots(Horizontal):
    """Perplexity on the left, efficiency and sync stacked on the right; below WIDE columns one of
    them fills the width (`cycle` shows the next)."""

    view = 0  # index into PLOT_IDS: the plot a narrow terminal shows

    def compose(self):
        yield PlotView(id="ppl-plot")
        with Vertical(id="site-plots"):
            yield PlotView(id="eff-plot")
            yield PlotView(id="sync-plot")

    def on_mount(self) -> None:
        self.lay_out()

    def on_resize(self) -> None:
        # shown for the first time, or the terminal changed: lay out and draw again at the new size
        self.lay_out()
        self.call_after_refresh(getattr(self.app, "replot", lambda: None))

    def wide(self) -> bool:
        return self.app.size.width >= WIDE

    def lay_out(self) -> None:
        wide = self.wide()
        pick = PLOT_IDS[self.view]
        self.query_one("#ppl-plot").display = wide or pick == "ppl-plot"
        self.query_one("#site-plots").display = wide or pick != "ppl-plot"
        self.query_one("#eff-plot").display = wide or pick == "eff-plot"
        self.query_one("#sync-plot").display = wide or pick == "sync-plot"
        self.set_class(not wide, "-one")

    def cycle(self) -> str:
        """Show the next plot (narrow terminals); returns its id."""
        self.view = (self.view + 1) % len(PLOT_IDS)
        self.lay_out()
        self.call_after_refresh(getattr(self.app, "replot", lambda: None))
        return PLOT_IDS[self.view]

    def sizes(self) -> dict[str, tuple[int, int]]:
        """{plot id: (width, height)} of the plots on screen."""
        return {pid: tuple(v.content_size) for pid in PLOT_IDS
                if (v := self.query_one(f"#{pid}", PlotView)).display and v.parent.display}

    def show(self, plots: dict[str, Text]) -> None:
        for pid, text in plots.items():
            self.query_one(f"#{pid}", PlotView).update(text)


class EmptyState(Static):
    """Shown instead of the plots while there is nothing to draw."""
