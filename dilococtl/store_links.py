"""Whether a run's checkpoint uploads share the WAN links with the exchange (tune-h and the plan say so).

A site's own `[[sites]] checkpoint_store` is taken to be in its region (that is what the field is for):
its uploads stay on the site's network. Every other store a site uploads to is not: a replica is by
definition another site's own store, and a store several sites name (the run-wide `[checkpoint] store`
among them) is in at most one of their regions. Uploads to those cross links the exchange also uses,
and a round-boundary upload then competes with the round's exchange for the link.
"""

from __future__ import annotations

from dilococtl.spec import RunSpec, site_stores


def crossing(spec: RunSpec) -> dict[str, list[str]]:
    """site -> the stores it uploads to outside its region ({} when every upload stays in its region)."""
    if len(spec.sites) < 2:
        return {}
    own = {i: s.checkpoint_store or spec.checkpoint.store for i, s in enumerate(spec.sites)}
    named_by = {u: sum(1 for v in own.values() if v == u) for u in own.values()}
    out: dict[str, list[str]] = {}
    for i, site in enumerate(spec.sites):
        stores = site_stores(spec, i)
        far = list(stores["replica_stores"])
        if stores["store"] and (not site.checkpoint_store or named_by[stores["store"]] > 1):
            far.insert(0, stores["store"])
        if far:
            out[site.name] = far
    return out


def note(spec: RunSpec) -> str | None:
    """One line when some site's checkpoint uploads cross the WAN links of the exchange, else None."""
    far = crossing(spec)
    if not far:
        return None
    who = ", ".join(f"{site} ({len(urls)} store{'s' if len(urls) > 1 else ''})" for site, urls in far.items())
    return (f"checkpoint: uploads share the WAN links with the exchange: {who} upload outside their region "
            f"(replicas, or a store several sites share); tune-h's H does not count that traffic")
