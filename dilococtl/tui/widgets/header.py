"""The run header: what runs, how far, how long; and how collection from the nodes is doing."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from dilococtl import fmt
from dilococtl.states import RunState, SiteState
from dilococtl.tui.data import Snapshot

# run and site states (the two enums share these values); a site's other states are unstyled, but lost
STATE_STYLE: dict[str, str] = {
    RunState.RUNNING: "bold green", RunState.LAUNCHING: "yellow", RunState.FINISHED: "bold cyan",
    RunState.FAILED: "bold red", RunState.STOPPED: "magenta", RunState.PREEMPTED: "bold yellow",
    SiteState.LOST: "bold red"}


LINES = 2  # the header never takes more rows than this
GAP = "  "


def _seg(*parts: tuple[str, str]) -> Text:
    t = Text()
    for text, style in parts:
        t.append(text, style=style)
    return t


def pack(segments: list[tuple[int, Text]], width: int, lines: int = LINES) -> list[Text]:
    """Lay whole segments (priority, text) on at most `lines` lines of `width` cells, in order.

    A segment is never cut across lines (no "rounds 8/10" / "(2 left)"); while they do not fit,
    the segment of least priority is left out. A segment wider than a line is shortened with "…".
    """
    segs = list(segments)
    width = max(width, 10)
    while True:
        out: list[Text] = [Text()]
        for _, seg in segs:
            seg = seg.copy()
            if seg.cell_len > width:
                seg.truncate(width, overflow="ellipsis")
            cur = out[-1]
            if cur.cell_len and cur.cell_len + len(GAP) + seg.cell_len > width:
                out.append(Text())
                cur = out[-1]
            if cur.cell_len:
                cur.append(GAP)
            cur.append_text(seg)
        if len(out) <= lines or len(segs) <= 1:
            return out[:lines]
        segs.remove(min(segs, key=lambda x: x[0]))


class RunHeader(Static):
    """Two lines: the run, its progress and its sync share; the collector's status. Whole phrases
    only: what does not fit the width is left out, least useful first."""

    _last: tuple | None = None

    def show(self, snap: Snapshot, *, now: float, status: str, paused: bool) -> None:
        self._last = (snap, now, status, paused)
        if snap.run is None:
            self.update(Text("dilococtl watch: no run", style="bold"))
            return
        run = snap.run
        done = snap.rounds_done
        left = max(0, snap.rounds_planned - done)
        eta = snap.eta_s()
        segs: list[tuple[int, Text]] = []
        if paused:
            segs.append((100, _seg((" PAUSED ", "bold reverse yellow"))))
        segs += [
            (99, _seg((run.name, "bold"))),
            (40, _seg((run.id, "dim"))),
            (95, _seg(("", ""), (run.state, STATE_STYLE.get(run.state, "")))),
            (50, _seg(("mode ", ""), (snap.mode, "bold"))),
            (90, _seg((f"rounds {done}/{snap.rounds_planned} ({left} left)", ""))),
            (60, _seg((f"elapsed {fmt.duration(snap.elapsed_s(now))}", ""))),
            (70, _seg((f"ETA {fmt.duration(eta) if eta is not None else '-'}", ""))),
        ]
        share = snap.metrics.sync_share if snap.metrics is not None else None
        if share is not None:
            text = f"sync {fmt.pct(share)} of round time"  # status's and report's digit (dilococtl/fmt.py)
            if snap.predicted_sync_share is not None:
                text += f" (tune-h {fmt.pct(snap.predicted_sync_share)})"
            segs.append((98, _seg((text, "bold"))))
        if snap.goodput is not None:  # dilococtl/goodput.py: status's digit
            segs.append((96, _seg(("goodput ", ""), (fmt.pct(snap.goodput), "bold"))))
        if status:
            bad = status.startswith("nodes:") and "ok" not in status
            segs.append((80 if bad else 30, _seg((status, "red" if bad else "dim"))))
        if snap.stalled:  # issue 41: a wait on a coordinator is never silent
            st = snap.stalled
            segs.append((97, _seg((f"STALLED {fmt.duration(max(0.0, now - st['since']))}: ", "bold reverse red"),
                                  (st["cause"], "red"))))
        if run.exit_reason:
            segs.append((85, _seg((f"reason: {run.exit_reason}", "italic"))))
        width = self.content_size.width or max(10, self.app.size.width - 2)
        self.update(Text("\n").join(pack(segs, width)))

    def on_resize(self) -> None:
        if self._last is not None:
            snap, now, status, paused = self._last
            self.show(snap, now=now, status=status, paused=paused)
