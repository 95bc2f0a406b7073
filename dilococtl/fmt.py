"""Number formats shared by every view: the dashboard, and the tables of status and report."""

from __future__ import annotations


def duration(seconds: float | None, *, days: bool = True, short: bool = False) -> str:
    """H:MM:SS, rounded to the second; "-" when unknown, 0 when negative.

    days: a day or more as `Nd H:MM:SS` (else the hours go on: `25:00:00`).
    short: under an hour as M:SS (`1:30`, not `0:01:30`).
    The `runs` table passes days=False, short=True; the dashboard, status and report the defaults.
    """
    if seconds is None:
        return "-"
    s = int(round(max(0.0, seconds)))
    d, s = divmod(s, 86400) if days else (0, s)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if short and not d and not h:
        return f"{m}:{s:02d}"
    return (f"{d}d " if d else "") + f"{h:d}:{m:02d}:{s:02d}"


def num(v: float | int | None, spec: str = "") -> str:
    if v is None:
        return "-"
    return format(v, spec) if spec else str(v)


def pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction * 100:.1f}%"


def si(v: float | None, unit: str = "") -> str:
    """1234567 -> '1.23M' (decimal prefixes)."""
    if v is None:
        return "-"
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= factor:
            return f"{v / factor:.2f}{prefix}{unit}"
    return f"{v:.0f}{unit}" if abs(v) >= 10 or v == 0 else f"{v:.2f}{unit}"
