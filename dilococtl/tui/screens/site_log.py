"""A site's trainer log, read from its nodes in a worker thread and followed while open.

Long lines (tracebacks, torchrun's errors) wrap at the screen's width rather than run off its edge:
a first-time user reads the cause of a failure here at 80 columns."""

from __future__ import annotations

from collections.abc import Callable

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, RichLog, Static

from dilococtl.errors import DilocoError
from dilococtl.logs import classify
from dilococtl.store import Node

MAX_LINES = 5000  # the log keeps this many rows, the tail of a long log (a wrapped line is several)
FOLLOW_S = 2.0


class SiteLogScreen(Screen[None]):
    BINDINGS = [Binding("escape,l", "app.pop_screen", "Back to the dashboard"),
                Binding("q", "app.quit", "Quit")]  # as everywhere in watch (its help says so)

    def __init__(self, site: str, nodes: list[Node], pool: Callable[[], object]) -> None:
        super().__init__()
        self.site = site
        self.nodes = [n for n in nodes if n.site == site and n.log_path]
        self.pool = pool  # returns the app's NodePool
        self.offsets = {n.host: 0 for n in self.nodes}
        self.partial = {n.host: b"" for n in self.nodes}
        self.errors: dict[str, str] = {}  # host -> the last error shown (shown again only when it changes)
        self._busy = False

    def compose(self) -> ComposeResult:
        yield Static(f"log of {self.site}: " + (", ".join(f"{n.host}:{n.log_path}" for n in self.nodes)
                                                 or "no log recorded for this site"), id="log-title")
        # min_width 1: wrap at the widget's width, whatever it is (RichLog's default is 78 columns)
        yield RichLog(max_lines=MAX_LINES, id="site-log", auto_scroll=True, wrap=True, min_width=1,
                      markup=False, highlight=False)
        yield Footer()

    def on_mount(self) -> None:
        self.read_more()
        self.set_interval(FOLLOW_S, self.read_more)

    def read_more(self) -> None:
        if not self._busy and self.nodes and not getattr(self.app, "paused", False):
            self._busy = True
            self._read()

    @work(thread=True, group="site-log")
    def _read(self) -> None:
        out: list[str] = []
        try:
            pool = self.pool()
            for n in self.nodes:
                prefix = f"[node{n.rank}] " if len(self.nodes) > 1 else ""
                try:
                    node = pool.get(n.host)
                    while True:
                        data = node.read_from(n.log_path, self.offsets[n.host])
                        self.offsets[n.host] += len(data)
                        lines = (self.partial[n.host] + data).split(b"\n")
                        self.partial[n.host] = lines.pop()
                        # library chatter (torchft's per-step INFO lines...) stays out, as in `logs`
                        texts = [ln.decode("utf-8", "replace") for ln in lines[-MAX_LINES:]]
                        out += [prefix + t for t in texts if not classify(t)[3]]
                        if len(data) < (4 << 20):
                            break
                    self.errors.pop(n.host, None)
                except DilocoError as e:
                    if self.errors.get(n.host) != str(e):
                        self.errors[n.host] = str(e)
                        out.append(f"{prefix}[{n.host}: {e}]")
        finally:
            self.app.call_from_thread(self._show, out)

    def _show(self, lines: list[str]) -> None:
        self._busy = False
        if lines:  # one write, one render: a first read may bring MAX_LINES lines
            self.query_one(RichLog).write(Text("\n".join(lines)))
