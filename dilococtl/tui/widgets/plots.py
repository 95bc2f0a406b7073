"""The curves: validation perplexity against tokens (per site and global), and the focused site's
compute efficiency and sync seconds per round.

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
    fig.plotsize(max(width, 10), max(height, 5))
    fig.theme("clear")  # the widget's background shows through
    return fig


def render_ppl(series: Series, width: int, height: int) -> Text:
    fig = _figure(width, height)
    for i, (site, buckets) in enumerate(series.sites.items()):
        pts = [(b.tokens, b.val_ppl) for b in buckets if b.val_ppl is not None]
        if pts:
            fig.plot([p[0] for p in pts], [p[1] for p in pts], label=site,
                     color=SITE_COLORS[i % len(SITE_COLORS)], marker="braille")
    gpts = [(x, y) for x, y in zip(series.global_tokens, series.global_ppl, strict=True) if y is not None]
    if gpts:
        fig.plot([p[0] for p in gpts], [p[1] for p in gpts], label="global", color="white", marker="dot")
    fig.title("validation perplexity vs tokens")
    fig.xlabel("tokens (global: all sites)")
    return Text.from_ansi(fig.build())


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
    return Text.from_ansi(fig.build())


def render_plots(series: Series, site: str, sizes: dict[str, tuple[int, int]]) -> dict[str, Text]:
    """The three plots at the given sizes ({plot id: (width, height)}); thread-safe."""
    return {
        "ppl-plot": render_ppl(series, *sizes["ppl-plot"]),
        "eff-plot": render_site(series, site, "efficiency", *sizes["eff-plot"]),
        "sync-plot": render_site(series, site, "sync", *sizes["sync-plot"]),
    }


class PlotView(Static):
    """Shows a plot rendered elsewhere."""


class Plots(Horizontal):
    """Perplexity on the left; efficiency and sync stacked on the right."""

    def compose(self):
        yield PlotView(id="ppl-plot")
        with Vertical(id="site-plots"):
            yield PlotView(id="eff-plot")
            yield PlotView(id="sync-plot")

    def on_resize(self) -> None:
        # shown for the first time, or the terminal changed: draw again at the new size
        self.call_after_refresh(getattr(self.app, "replot", lambda: None))

    def sizes(self) -> dict[str, tuple[int, int]]:
        return {pid: tuple(self.query_one(f"#{pid}", PlotView).content_size) for pid in PLOT_IDS}

    def show(self, plots: dict[str, Text]) -> None:
        for pid, text in plots.items():
            self.query_one(f"#{pid}", PlotView).update(text)


class EmptyState(Static):
    """Shown instead of the plots while there is nothing to draw."""
