"""The sites table: one row per site, the columns that fit the width, sortable, the focused site's row
highlighted. Column names and meanings: dilococtl/columns.py (the same in status and report)."""

from __future__ import annotations

import math

from rich.text import Text
from textual.widgets import DataTable

from dilococtl import columns, fmt
from dilococtl.queries import SiteStat
from dilococtl.states import SiteState
from dilococtl.store import Node
from dilococtl.tui.widgets.header import STATE_STYLE

CELL_PAD = 2  # DataTable's padding around each cell (one each side)
GUTTER = 2  # room kept for the vertical scrollbar (many sites)


def site_state(stat: SiteStat, nodes: list[Node]) -> str:
    """The site's state; "lost" when one of its nodes stopped answering."""
    if any(n.state == SiteState.LOST for n in nodes if n.site == stat.site):
        return SiteState.LOST
    return stat.state


def cells(stat: SiteStat, nodes: list[Node]) -> dict[str, object]:
    """Every column's cell of a site, by column key."""
    state = site_state(stat, nodes)
    return {
        "site": stat.site,
        "state": Text(state, style=STATE_STYLE.get(state, "")),
        "round": str(stat.round),
        "step": str(stat.step),
        "k": "-" if stat.k_active is None else f"{stat.k_active}/{stat.k_nominal}",
        "efficiency": fmt.pct(stat.efficiency),
        "staleness": fmt.num(stat.staleness),
        "last_sync_s": fmt.num(stat.last_sync_s, ".2f"),
        "wan_bps": fmt.si(stat.wan_bps, "B/s"),
        "tokens_per_s": fmt.si(stat.tokens_per_s),
        "mfu": fmt.pct(stat.mfu),
        "train_loss": fmt.num(stat.train_loss, ".3f"),
        "val_ppl": fmt.num(stat.val_ppl, ".2f"),
        "bytes_sent": f"{stat.bytes_sent / 1e6:.1f}",
    }


def sort_value(stat: SiteStat, key: str) -> tuple:
    """What a column sorts by: its number (unknown last), else its text."""
    if key == "k":
        v = stat.k_active
    elif key == "state":
        return (0, stat.state)
    else:
        v = getattr(stat, key)
    if isinstance(v, str):
        return (0, v)
    return (1, 0.0) if v is None or (isinstance(v, float) and math.isnan(v)) else (0, v)


def row(stat: SiteStat, nodes: list[Node]) -> list[object]:
    """A site's cells in the order of dilococtl.columns (every column)."""
    c = cells(stat, nodes)
    return [c[col.key] for col in columns.SITE_COLUMNS]


class SitesTable(DataTable):
    """Rows keyed by site name; `show` replaces them and keeps the cursor on `focused`."""

    sort_key: str | None = None  # None: the spec's site order
    sort_reverse: bool = False

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.zebra_stripes = True
        self.shown: list[str] = []  # column keys on screen
        self._last: tuple | None = None

    def show(self, stats: list[SiteStat], nodes: list[Node], focused: str) -> None:
        """Update the rows; cells change in place while the sites and columns stay the same."""
        self._last = (stats, nodes, focused)
        by_site = {s.site: cells(s, nodes) for s in stats}
        widths = {c.key: max([len(c.name)] + [v.cell_len if isinstance(v, Text) else len(str(v))
                                              for v in (r[c.key] for r in by_site.values())])
                  for c in columns.SITE_COLUMNS}
        room = (self.size.width or self.app.size.width - 2) - GUTTER  # size: inside the border
        keys = columns.fit(widths, room, pad=CELL_PAD)
        order = [s.site for s in stats]
        if self.sort_key is not None:
            st = {s.site: s for s in stats}
            order.sort(key=lambda name: sort_value(st[name], self.sort_key), reverse=self.sort_reverse)
            if self.sort_reverse:  # unknown values stay last either way
                order.sort(key=lambda name: sort_value(st[name], self.sort_key)[0])
        if keys != self.shown:
            self.clear(columns=True)
            for k in keys:
                self.add_column(columns.BY_KEY[k].name, key=k)
            self.shown = keys
        if order != [k.value for k in self.rows]:
            self.clear()
            for site in order:
                self.add_row(*[by_site[site][k] for k in keys], key=site)
        else:
            for site in order:
                for k in keys:
                    if self.get_cell(site, k) != by_site[site][k]:
                        self.update_cell(site, k, by_site[site][k], update_width=True)
        self.border_title = self.title()
        self.focus_site(focused)

    def title(self) -> str:
        hidden = len(columns.SITE_COLUMNS) - len(self.shown)
        out = "sites"
        if self.sort_key is not None:
            out += f" · by {columns.BY_KEY[self.sort_key].name} {'↓' if self.sort_reverse else '↑'}"
        if hidden:
            out += f" · {hidden} column(s) need a wider terminal"
        return out

    def sort_by(self, key: str | None, reverse: bool | None = None) -> None:
        """Sort the rows by a column key (None: the spec's order); the same key again flips the order."""
        if reverse is None:
            reverse = (not self.sort_reverse) if key == self.sort_key else False
        self.sort_key, self.sort_reverse = key, reverse
        self.redraw()

    def cycle_sort(self) -> None:
        """Sort by the next column on screen (after the last: the spec's order)."""
        keys = self.shown or [c.key for c in columns.SITE_COLUMNS]
        if self.sort_key not in keys:
            nxt = keys[0]
        else:
            i = keys.index(self.sort_key) + 1
            nxt = keys[i] if i < len(keys) else None
        self.sort_by(nxt, reverse=False)

    def redraw(self) -> None:
        if self._last is not None:
            self.show(*self._last)

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        event.stop()
        self.sort_by(event.column_key.value)

    def on_resize(self) -> None:
        self.redraw()

    def focus_site(self, site: str) -> None:
        try:
            idx = self.get_row_index(site)
        except Exception:  # no such row (yet)
            return
        if self.cursor_row != idx:
            self.move_cursor(row=idx, animate=False)
