"""The events pane: preemptions, heals, quorum changes, rejections, checkpoints, errors; scrollable
(focus it with `e`, or the mouse wheel) and filtered by kind with `f`."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import RichLog

from dilococtl import fmt
from dilococtl.store import Event

EVENT_STYLE = {"error": "bold red", "preempted": "bold yellow", "heal": "cyan", "h_changed": "magenta",
               "quorum": "blue", "checkpoint": "dim", "checkpoint_skipped": "yellow", "resume": "green",
               "start": "green", "stopped": "bold", "rejected": "bold magenta", "diverging": "bold red"}
MAX_EVENTS = 5000  # older events are dropped from the pane (the store keeps them all)
# `f` cycles through these: (name shown in the pane's title, event kinds; None: every kind)
FILTERS: tuple[tuple[str, frozenset[str] | None], ...] = (
    ("all", None),
    ("heals", frozenset({"heal", "resume"})),
    ("quorum changes", frozenset({"quorum"})),
    ("rejections", frozenset({"rejected"})),
    ("problems", frozenset({"error", "diverging", "preempted", "checkpoint_skipped", "rejected"})),
)


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
        super().__init__(max_lines=MAX_EVENTS, wrap=False, markup=False, auto_scroll=True, **kw)
        self.events: list[Event] = []  # every event received (the newest MAX_EVENTS)
        self.since = 0.0
        self.filter = 0  # index into FILTERS

    @property
    def count(self) -> int:
        return len(self.events)

    def kinds(self) -> frozenset[str] | None:
        return FILTERS[self.filter][1]

    def shown(self) -> list[Event]:
        kinds = self.kinds()
        return [e for e in self.events if kinds is None or e.event in kinds]

    def add(self, events: list[Event], since: float) -> None:
        self.since = since
        self.events = (self.events + events)[-MAX_EVENTS:]
        kinds = self.kinds()
        for ev in events:
            if kinds is None or ev.event in kinds:
                self.write(line(ev, since))
        self._title()

    def cycle_filter(self) -> str:
        """Show the next kind of events (all, heals, quorum changes, rejections, problems)."""
        self.filter = (self.filter + 1) % len(FILTERS)
        self.clear()
        for ev in self.shown():
            self.write(line(ev, self.since))
        self._title()
        return FILTERS[self.filter][0]

    def _title(self) -> None:
        name = FILTERS[self.filter][0]
        self.border_title = "events" if name == "all" else f"events · {name} ({len(self.shown())} of {self.count})"
        self.border_subtitle = "f filter · e scroll" if self.count else ""
