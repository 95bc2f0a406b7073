"""Runs recorded in a store the way the collector records them (Store.ingest of metrics lines).

Times and run ids are fixed so that what the dashboard shows is the same on every machine.
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

from dilococtl.spec import spec_from_dict
from dilococtl.store import Store
from trainer.records import EventRecord, RoundRecord, StepRecord, to_line

T0 = 1_767_225_600.0  # 2026-01-01 00:00:00 UTC: every fixture run is launched then
ROUND_S = 12.0  # wall seconds of one round (compute + sync) in the fixtures
NOW = T0 + 3600.0  # the frozen "now" of the snapshot tests


SPEC_TOML = """
[run]
name = "local-2site"
[model]
preset = "tiny"
[data]
source = "shakespeare"
seq_len = 64
batch_size = 16
[diloco]
h = 20
rounds = 10
mode = "sync"
[[sites]]
name = "site-a"
hosts = ["local"]
work_dir = "/tmp/dilococtl-test"
[[sites]]
name = "site-b"
hosts = ["local"]
work_dir = "/tmp/dilococtl-test"
"""


def spec():
    """Two local sites, 10 rounds of H=20 (fixed here: the playbooks may change)."""
    return spec_from_dict(tomllib.loads(SPEC_TOML), "playbooks/local-2site.toml")


def ppl_at(r: int) -> float:
    """A falling validation perplexity."""
    return 4.0 + 60.0 / math.sqrt(r)


def round_line(site: str, r: int, *, sync_s: float = 1.5, k_active: int = 2, staleness: int = 0) -> str:
    return to_line(RoundRecord(
        round=r, step=20 * r, h=20, compute_s=ROUND_S - sync_s, sync_s=sync_s, bytes_sent=500_000,
        bytes_recv=500_000, k_active=k_active, k_nominal=2, outer_lr=0.7 * k_active / 2, committed=True,
        staleness=staleness, train_loss=math.log(ppl_at(r)) + 0.05, val_loss=math.log(ppl_at(r)),
        val_ppl=ppl_at(r), tokens=20 * 1024 * r, site=site, t=T0 + ROUND_S * r))


def step_line(site: str, step: int, tokens_per_s: float) -> str:
    return to_line(StepRecord(step=step, round=(step - 1) // 20 + 1, loss=2.0, lr=3e-3, step_s=0.5,
                              tokens_per_s=tokens_per_s, site=site, t=T0 + 0.6 * step))


def event_line(site: str, event: str, message: str, r: int | None, t: float) -> str:
    return to_line(EventRecord(event=event, message=message, round=r, site=site, t=t))


def add_rounds(store: Store, run_id: str, site: str, first: int, last: int, **kw) -> None:
    """Record rounds first..last of `site` (through Store.ingest, as the collector does)."""
    lines = [round_line(site, r, **kw) for r in range(first, last + 1)]
    path = f"/runs/{run_id}/{site}/metrics.jsonl"
    store.ingest(run_id, site, "local", path, store.offset(run_id, site, "local", path) + 1, lines)


def make_run(store: Store, *, run_id: str = "20260101-000000-a1b2", state: str = "running", rounds: int = 6,
             preempted: str | None = None, log_dir: Path | None = None, with_data: bool = True):
    """A local-2site run with `rounds` rounds per site (the `preempted` site stops 2 rounds early)."""
    store.create_run(spec(), run_id=run_id, state="launching")
    store.db.conn.execute("UPDATE runs SET created = ?, updated = ? WHERE id = ?", (T0, T0, run_id))
    if state != "launching":
        store.set_run_state(run_id, "running")
    for site in ("site-a", "site-b"):
        log_path = str(log_dir / f"{site}.log") if log_dir is not None else None
        store.set_node(run_id, site, "local", state="running", pid=4242, log_path=log_path)
        store.set_site_state(run_id, site, "running")
        if not with_data:
            continue
        n = rounds - 2 if site == preempted else rounds
        add_rounds(store, run_id, site, 1, n, sync_s=1.5 if site == "site-a" else 2.5)
        lines = [step_line(site, s, 40_000.0 if site == "site-a" else 38_000.0) for s in range(1, 20 * n + 1, 7)]
        lines += [event_line(site, "start", f"site {site} rank 0/1: 125248 params", 0, T0 + 1.0)]
        lines += [event_line(site, "checkpoint", f"checkpoint round {r} complete (0.10 s)", r,
                             T0 + ROUND_S * r + 0.5) for r in range(2, n + 1, 2)]
        if site == preempted:
            lines.append(event_line(site, "preempted", "SIGTERM: stopped at a safe point", n, T0 + ROUND_S * n + 1))
        path = f"/runs/{run_id}/{site}/events.jsonl"
        store.ingest(run_id, site, "local", path, 1, lines)
    if preempted:
        store.set_node(run_id, preempted, "local", state="preempted")
        store.set_site_state(run_id, preempted, "preempted")
        if with_data:
            store.add_event(run_id, "heal", "site-a continues alone (K_active 1)", site="site-a",
                            round=rounds - 1, t=T0 + ROUND_S * (rounds - 1) + 2)
    if state == "finished":
        for site in ("site-a", "site-b"):
            store.set_node(run_id, site, "local", state="finished")
            store.set_site_state(run_id, site, "finished")
        store.set_run_state(run_id, "finished")
        store.db.conn.execute("UPDATE runs SET finished = ?, updated = ? WHERE id = ?",
                              (T0 + ROUND_S * rounds + 5, T0 + ROUND_S * rounds + 5, run_id))
    elif state not in ("running", "launching"):
        store.set_run_state(run_id, state)
    store.db.conn.commit()
    return store.get_run(run_id)
