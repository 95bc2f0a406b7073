"""The run header: what runs, how far, how long; and how collection from the nodes is doing."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from dilococtl.states import RunState, SiteState
from dilococtl.tui import fmt
from dilococtl.tui.data import Snapshot

# run and site states (the two enums share these values); a site's other states are unstyled, but lost
STATE_STYLE: dict[str, str] = {
    RunState.RUNNING: "bold green", RunState.LAUNCHING: "yellow", RunState.FINISHED: "bold cyan",
    RunState.FAILED: "bold red", RunState.STOPPED: "magenta", RunState.PREEMPTED: "bold yellow",
    SiteState.LOST: "bold red"}


class RunHeader(Static):
    """Two lines: the run and its progress; the collector's status."""

    def show(self, snap: Snapshot, *, now: float, status: str, paused: bool) -> None:
        if snap.run is None:
            self.update(Text("dilococtl watch: no run", style="bold"))
            return
        run = snap.run
        line = Text()
        line.append(f"{run.name}", style="bold")
        line.append(f" {run.id}  ", style="dim")
        line.append("mode ")
        line.append(snap.mode, style="bold")
        line.append("  state ")
        line.append(run.state, style=STATE_STYLE.get(run.state, ""))
        line.append(f"  elapsed {fmt.duration(snap.elapsed_s(now))}")
        done = snap.rounds_done
        left = max(0, snap.rounds_planned - done)
        line.append(f"  rounds {done}/{snap.rounds_planned} ({left} left)")
        eta = snap.eta_s()
        line.append(f"  ETA {fmt.duration(eta) if eta is not None else '-'}")

        second = Text()
        if paused:
            second.append(" PAUSED ", style="bold reverse yellow")
            second.append("  ")
        share = snap.metrics.sync_share if snap.metrics is not None else None
        if share is not None:
            second.append(f"sync {share * 100:.1f}% of round time")
            if snap.predicted_sync_share is not None:
                second.append(f" (tune-h {snap.predicted_sync_share * 100:.1f}%)")
            second.append("  ")
        second.append(status, style="red" if status.startswith("nodes:") and "ok" not in status else "dim")
        if run.exit_reason:
            second.append(f"  reason: {run.exit_reason}", style="italic")
        self.update(Text("\n").join([line, second]))
