"""Number formats shared by every view: the dashboard, and the tables of status and report."""

from __future__ import annotations


def duration(seconds: float | None) -> str:
    """H:MM:SS (days as `Nd HH:MM:SS`); "-" when unknown."""
    if seconds is None:
        return "-"
    s = int(round(max(0.0, seconds)))
    days, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{days}d " if days else "") + f"{h:d}:{m:02d}:{s:02d}"


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
