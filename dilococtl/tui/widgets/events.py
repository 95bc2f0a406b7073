"""The events log: preemptions, heals, checkpoints, H changes, errors, as they arrive."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import RichLog

from dilococtl.store import Event
from dilococtl.tui import fmt

EVENT_STYLE = {"error": "bold red", "preempted": "bold yellow", "heal": "cyan", "h_changed": "magenta",
               "quorum": "blue", "checkpoint": "dim", "checkpoint_skipped": "yellow", "resume": "green",
               "start": "green", "stopped": "bold"}
MAX_LINES = 2000  # older lines scroll away


def line(ev: Event, since: float) -> Text:
    """`+H:MM:SS site event [round] message`; times relative to the run's launch (no time zone)."""
    t = Text()
    t.append(f"+{fmt.duration(ev.t - since)} ", style="dim")
    t.append(f"{ev.site or 'run':<8} ", style="bold")
    t.append(f"{ev.event:<11}", style=EVENT_STYLE.get(ev.event, ""))
    if ev.round is not None:
        t.append(f" r{ev.round}", style="dim")
    if ev.message:
        t.append(f" {ev.message}")
    return t


class EventsLog(RichLog):
    def __init__(self, **kw) -> None:
        super().__init__(max_lines=MAX_LINES, wrap=False, markup=False, auto_scroll=True, **kw)
        self.count = 0  # events written (lines may have scrolled away)

    def add(self, events: list[Event], since: float) -> None:
        for ev in events:
            self.write(line(ev, since))
        self.count += len(events)
