"""`dilococtl checkpoints`: a run's rounds in its object stores, per site and store, verified or why not."""

from __future__ import annotations

import time

from dilococtl.cli import app
from dilococtl.cli._common import JsonOpt, RunArg, SiteOpt, emit_json, print_table
from dilococtl.lookup import pick_run, read_store


@app.command()
def checkpoints(run: RunArg, site: SiteOpt = None, json_out: JsonOpt = False) -> None:
    """List RUN's checkpoint rounds in each site's stores: size, age, verified or the reason not.

    Credentials come from the AWS chain of this shell (environment, profile, instance role).

    Example: dilococtl checkpoints local-2site --json
    """
    from dilococtl import checkpoints as ck
    from dilococtl.errors import BadInput
    from trainer.checkpoints.store_rounds import age

    with read_store() as store:
        if store is None:
            raise BadInput("no runs recorded yet")
        r = pick_run(store, run)
    if not ck.has_stores(r):
        raise BadInput(f"run {r.id} has no checkpoint store ([checkpoint] store or [[sites]] checkpoint_store)")
    entries = ck.list_run(r, sites=[site] if site else None)
    if site and not entries:
        raise BadInput(f"run {r.id} has no site {site!r}")
    if json_out:
        emit_json({"id": r.id, "sites": ck.to_json(entries)})
        return
    now = time.time()
    rows = []
    for e in entries:
        for url in e.stores:
            if url in e.errors:
                rows.append([e.site, url, "-", "-", "-", f"unreadable: {e.errors[url]}"])
            for x in e.rounds.get(url, []):
                rows.append([e.site, url, x.round, f"{x.bytes / 1e6:.1f} MB", age(x.created, now),
                             "verified" if not x.why else x.why])
            if url not in e.errors and not e.rounds.get(url):
                rows.append([e.site, url, "-", "-", "-", "no rounds"])
    print_table(f"run {r.id}: checkpoints in its stores", ["site", "store", "round", "size", "age", "verified"], rows)
