"""What every sink receives, and the one interface every sink implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

GLOBAL = "global"  # series of all sites together are named GLOBAL/<metric> (per site: <metric>/<site>)


@dataclass(kw_only=True, slots=True)
class Point:
    """One round of the run: its values, per site and for all sites, at one x."""

    round: int
    tokens: int  # the x axis, as in watch: tokens of all sites at this round
    t: float  # unix seconds of the round's newest record
    values: dict[str, float] = field(default_factory=dict)  # "val_ppl/site-a", "global/val_ppl", ...


@dataclass(kw_only=True, slots=True)
class EventLine:
    """One event of the run, as text."""

    id: int  # the store's event id: events are exported in id order, each once
    t: float
    tokens: int  # x of the newest exported round when it was exported
    site: str  # "" = the run as a whole
    event: str
    message: str
    round: int | None

    @property
    def text(self) -> str:
        where = self.site or "run"
        at = f" round {self.round}" if self.round is not None else ""
        return f"{where}{at}: {self.event}: {self.message}"


@dataclass(kw_only=True, slots=True)
class RunInfo:
    """What a sink needs to know of the run it writes."""

    id: str
    name: str
    dir: Path  # the sink's own directory under the run's local directory
    state: dict  # the sink's saved state (dilococtl.sinks.feed keeps it; a sink may add keys)


class Sink(ABC):
    """A place metrics go. open once per process, write each new batch, close at exit."""

    name: str = ""

    @abstractmethod
    def open(self, run: RunInfo) -> None:
        """Create or resume the run at the sink."""

    @abstractmethod
    def write(self, points: list[Point], events: list[EventLine]) -> None:
        """Write these new points and events (each is given once) and make them durable."""

    def close(self) -> None:
        """Finish the run at the sink (the process ends); the default has nothing to finish."""
        return None
