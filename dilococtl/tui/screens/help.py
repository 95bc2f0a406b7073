"""The help screen: every key of the dashboard, and what each column of the sites table means
(the names and meanings of dilococtl/columns.py, shared with status and report)."""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static


def _table(rows: list[tuple[str, str]]) -> Table:
    table = Table(show_header=False, box=None, padding=(0, 2, 0, 0), expand=True)
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column(ratio=1)
    for a, b in rows:
        table.add_row(a, b)
    return table


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "app.pop_screen", "Close help")]

    def __init__(self, keys: list[tuple[str, str]], cols: list[tuple[str, str]] | None = None) -> None:
        super().__init__()
        self.keys = keys  # (key as shown, what it does)
        self.cols = cols or []  # (column name, what it means)

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box"):
            yield Static("dilococtl watch: keys", id="help-title", classes="help-title")
            yield Static(_table(self.keys), id="help-keys")
            if self.cols:
                yield Static("columns of the sites table", id="help-cols-title", classes="help-title")
                yield Static(_table(self.cols), id="help-cols")
            yield Static("Esc closes this help; up/down scroll it.", id="help-foot")
