"""The help screen: every key of the dashboard and what it does (built from the app's bindings)."""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "app.pop_screen", "Close help")]

    def __init__(self, keys: list[tuple[str, str]]) -> None:
        super().__init__()
        self.keys = keys  # (key as shown, what it does)

    def compose(self) -> ComposeResult:
        table = Table(show_header=False, box=None, padding=(0, 2))
        table.add_column(style="bold cyan")
        table.add_column()
        for key, text in self.keys:
            table.add_row(key, text)
        with Vertical(id="help-box"):
            yield Static("dilococtl watch: keys", id="help-title")
            yield Static(table, id="help-keys")
            yield Static("ctrl+p opens the command palette.  Esc closes this help.", id="help-foot")
