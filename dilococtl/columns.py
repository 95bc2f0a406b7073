"""The per-site columns every view shows: one name and one meaning each.

`status`, `watch` (its table and its `?` screen) and `report` take their headers from here, so a
figure has the same name wherever it appears. `keep` orders what a narrow view gives up first
(lowest first); the figures themselves come from dilococtl.metrics and dilococtl.queries.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Column:
    key: str  # the field of dilococtl.queries.SiteStat (or derived from it) it shows
    name: str  # the header, the same in every view
    help: str  # what it means, one line (watch's `?`)
    keep: int  # a narrow view drops the lowest first (100: never dropped)


SITE_COLUMNS: tuple[Column, ...] = (
    Column(key="site", name="site", keep=100, help="site (datacenter) name from the spec"),
    Column(key="state", name="state", keep=100,
           help="running, finished, failed, stopped, preempted; lost: a node stopped answering"),
    Column(key="round", name="round", keep=90, help="newest outer round the site recorded"),
    Column(key="step", name="step", keep=20, help="inner steps the site has done (all rounds)"),
    Column(key="k", name="K", keep=70,
           help="sites in the newest round's average / sites planned (K_active/K_nominal)"),
    Column(key="efficiency", name="eff", keep=80,
           help="compute efficiency: compute / (compute + sync) seconds over the site's rounds"),
    Column(key="staleness", name="stale", keep=30,
           help="rounds between the parameters a delta was computed on and its application (0 in sync mode)"),
    Column(key="last_sync_s", name="sync s", keep=60, help="seconds of the newest round's exchange and outer step"),
    Column(key="wan_bps", name="WAN", keep=65, help="bytes sent + received per second of the newest round's sync"),
    Column(key="tokens_per_s", name="tok/s", keep=75, help="tokens per second of the whole site (newest step)"),
    Column(key="mfu", name="MFU", keep=50, help="model FLOPs utilisation: tok/s x training FLOPs per token / the "
           "peak of the site's devices (dense bf16; train.peak_tflops); - where the peak is unknown, as on a CPU"),
    Column(key="train_loss", name="loss", keep=40, help="mean training loss of the newest round"),
    Column(key="val_ppl", name="val ppl", keep=85, help="validation perplexity after the newest evaluated outer step"),
    Column(key="bytes_sent", name="MB sent", keep=10, help="megabytes this site put on the WAN over the run"),
)
BY_KEY = {c.key: c for c in SITE_COLUMNS}


def fit(widths: dict[str, int], room: int, *, pad: int = 2) -> list[str]:
    """The keys of the columns to show in `room` cells: dropped lowest `keep` first, shown in order.

    `widths`: each column's content width (header or widest value); `pad`: the cells around each.
    """
    keys = [c.key for c in SITE_COLUMNS if c.key in widths]
    shown = set(keys)
    for c in sorted((BY_KEY[k] for k in keys), key=lambda c: c.keep):
        if sum(widths[k] + pad for k in shown) <= room or c.keep >= 100:
            break
        shown.discard(c.key)
    return [k for k in keys if k in shown]


def text_cells(s: Mapping[str, Any], rounds_planned: int | None = None) -> dict[str, str]:
    """A site's cells as text, by column key, from a `status --json` site (or a SiteStat as a dict).

    `rounds_planned`: show the round as "done/planned". The dashboard styles its own (state colours).
    """
    from dilococtl import fmt  # number formats only: no textual import

    k = "-" if s.get("k_active") is None else f"{s['k_active']}/{s.get('k_nominal') or '?'}"
    rnd = f"{s['round']}/{rounds_planned}" if rounds_planned is not None else str(s["round"])
    return {"site": s["site"], "state": str(s["state"]), "round": rnd, "step": str(s["step"]), "k": k,
            "efficiency": fmt.pct(s.get("efficiency")), "staleness": fmt.num(s.get("staleness")),
            "last_sync_s": fmt.num(s.get("last_sync_s"), ".2f"), "wan_bps": fmt.si(s.get("wan_bps"), "B/s"),
            "tokens_per_s": fmt.si(s.get("tokens_per_s")), "mfu": fmt.pct(s.get("mfu")),
            "train_loss": fmt.num(s.get("train_loss"), ".3f"),
            "val_ppl": fmt.num(s.get("val_ppl"), ".3f"), "bytes_sent": f"{(s.get('bytes_sent') or 0) / 1e6:.1f}"}
