"""The sites table: one row per site, the focused site's row highlighted."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import DataTable

from dilococtl.queries import SiteStat
from dilococtl.states import SiteState
from dilococtl.store import Node
from dilococtl.tui import fmt
from dilococtl.tui.widgets.header import STATE_STYLE

COLUMNS = ("site", "state", "round", "step", "compute eff", "staleness", "K_active", "last sync s",
           "WAN", "tokens/s", "val ppl")


def site_state(stat: SiteStat, nodes: list[Node]) -> str:
    """The site's state; "lost" when one of its nodes stopped answering."""
    if any(n.state == SiteState.LOST for n in nodes if n.site == stat.site):
        return SiteState.LOST
    return stat.state


def row(stat: SiteStat, nodes: list[Node]) -> list[object]:
    state = site_state(stat, nodes)
    k = "-" if stat.k_active is None else f"{stat.k_active}/{stat.k_nominal}"
    return [stat.site, Text(state, style=STATE_STYLE.get(state, "")),
            str(stat.round), str(stat.step), fmt.pct(stat.efficiency), fmt.num(stat.staleness), k,
            fmt.num(stat.last_sync_s, ".2f"), fmt.si(stat.wan_bps, "B/s"), fmt.si(stat.tokens_per_s),
            fmt.num(stat.val_ppl, ".2f")]


class SitesTable(DataTable):
    """Rows keyed by site name; `show` replaces them and keeps the cursor on `focused`."""

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.zebra_stripes = True
        for col in COLUMNS:
            self.add_column(col, key=col)

    def show(self, stats: list[SiteStat], nodes: list[Node], focused: str) -> None:
        """Update the rows; cells are changed in place while the sites stay the same (no relayout)."""
        rows = {stat.site: row(stat, nodes) for stat in stats}
        if list(rows) != [k.value for k in self.rows]:
            self.clear()
            for site, cells in rows.items():
                self.add_row(*cells, key=site)
        else:
            for site, cells in rows.items():
                for col, value in zip(COLUMNS, cells, strict=True):
                    if self.get_cell(site, col) != value:
                        self.update_cell(site, col, value, update_width=True)
        self.focus_site(focused)

    def focus_site(self, site: str) -> None:
        try:
            idx = self.get_row_index(site)
        except Exception:  # no such row (yet)
            return
        if self.cursor_row != idx:
            self.move_cursor(row=idx, animate=False)
