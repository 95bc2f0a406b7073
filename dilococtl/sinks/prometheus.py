"""`dilococtl metrics serve`: a Prometheus exporter of live runs, read from the store at each scrape.

Every scrape opens the store, reads the figures status and watch show (dilococtl.queries.site_stats,
dilococtl.runs.run_summary) for each live run (launching, running, preempted; plus runs named with
--run) and answers them; nothing is cached, so what Prometheus sees is what `status` prints. Labels:
`run` (the run id) and `site`; the run's name and state are on `dilococtl_run_info`. Names follow
Prometheus' conventions: base units (`_seconds`, `_bytes`), `_total` on counters, `_ratio` on 0..1.

A run's events (preemptions, heals, quorum changes, errors...) are served for Grafana's annotations
as `dilococtl_event_timestamp_seconds`: one series per event, its value the event's time, labels
run, site, event, id and message. Grafana's Prometheus annotation with "series value as timestamp"
draws each at its own time, however far apart the scrapes are (playbooks/grafana/dilococtl.json).
Only the newest ANNOTATED_EVENTS of a run are served, so the series stay few; one that drops out
keeps its samples in Prometheus and its mark on the dashboard.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from dilococtl.states import ACTIVE_RUN_STATES

PREFIX = "dilococtl_"
DEFAULT_PORT = 9464  # the port OpenTelemetry's Prometheus exporter uses by default
ANNOTATED_EVENTS = 50  # newest events of a run served for annotations (a series each: keep them few)
ROUTINE_EVENTS = ("checkpoint",)  # one per site per round: a mark on every round would hide the others
MESSAGE_CHARS = 160  # an event's message is a label: cut, as a tooltip shows it


@dataclass(frozen=True, slots=True)
class Family:
    name: str  # without PREFIX (and without _total: prometheus_client adds it to counters)
    kind: str  # "gauge" or "counter"
    help: str
    attr: str  # the dilococtl.queries.SiteStat field it reads


SITE_FAMILIES = (
    Family("val_perplexity", "gauge", "Newest validation perplexity of the site", "val_ppl"),
    Family("train_loss", "gauge", "Mean inner training loss of the site's newest round", "train_loss"),
    Family("round", "gauge", "Newest outer round the site recorded", "round"),
    Family("tokens", "counter", "Tokens the site has trained on", "tokens"),
    Family("tokens_per_second", "gauge", "Tokens per second of the site's newest step", "tokens_per_s"),
    Family("last_sync_seconds", "gauge", "Seconds of the site's newest outer exchange", "last_sync_s"),
    Family("compute_efficiency_ratio", "gauge", "Compute / (compute + sync) of the site over the run",
           "efficiency"),
    Family("staleness_rounds", "gauge", "Rounds between the parameters of the site's newest delta and its use",
           "staleness"),
    Family("sent_bytes", "counter", "Payload bytes the site put on the WAN", "bytes_sent"),
    Family("received_bytes", "counter", "Payload bytes the site received from the WAN", "bytes_recv"),
    Family("active_sites", "gauge", "Sites in the newest round's quorum (K active), as the site saw it", "k_active"),
    Family("nominal_sites", "gauge", "Sites the run was planned with (K nominal)", "k_nominal"),
)


class StoreCollector:
    """A prometheus_client collector over the store at `db_path`."""

    def __init__(self, db_path: Path, runs: Iterable[str] = ()) -> None:
        self.db_path = Path(db_path)
        self.runs = list(runs)  # runs exported even when they are no longer live

    def collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from dilococtl import queries
        from dilococtl import runs as runs_mod
        from dilococtl.store import Store

        info = GaugeMetricFamily(PREFIX + "run_info", "A run the exporter shows (value 1)",
                                 labels=["run", "name", "state"])
        share = GaugeMetricFamily(PREFIX + "sync_share_ratio", "Sync share of round time of the run",
                                  labels=["run"])
        rounds = GaugeMetricFamily(PREFIX + "rounds_planned", "Outer rounds the run is planned for", labels=["run"])
        fams = {f.name: (CounterMetricFamily if f.kind == "counter" else GaugeMetricFamily)(
            PREFIX + f.name, f.help, labels=["run", "site"]) for f in SITE_FAMILIES}
        events = CounterMetricFamily(PREFIX + "events", "Events recorded, by kind", labels=["run", "site", "event"])
        marks = GaugeMetricFamily(PREFIX + "event_timestamp_seconds",
                                  "Time of one of the run's newest events (for Grafana annotations)",
                                  labels=["run", "site", "event", "id", "message"])
        if self.db_path.exists():
            with Store.open(self.db_path) as store:
                chosen = {r.id: r for r in store.list_runs() if r.state in ACTIVE_RUN_STATES}
                for name in self.runs:
                    r = store.get_run(name)
                    chosen[r.id] = r
                for r in chosen.values():
                    summary = runs_mod.run_summary(r, store)
                    info.add_metric([r.id, r.name, r.state], 1)
                    if summary["sync_share"] is not None:
                        share.add_metric([r.id], summary["sync_share"])
                    rounds.add_metric([r.id], summary["rounds_planned"])
                    for st in queries.site_stats(store, r.id):
                        for f in SITE_FAMILIES:
                            v = getattr(st, f.attr)
                            if v is not None and math.isfinite(v):
                                fams[f.name].add_metric([r.id, st.site], float(v))
                    for site, event, n in store.db.conn.execute(
                            "SELECT site, event, count(*) FROM events WHERE run_id = ? GROUP BY site, event", (r.id,)):
                        events.add_metric([r.id, site, event], n)
                    for ev_id, site, event, message, t in _newest_events(store, r.id):
                        marks.add_metric([r.id, site, event, str(ev_id), _one_line(message)], t)
        yield info
        yield share
        yield rounds
        yield from fams.values()
        yield events
        yield marks


def _newest_events(store, run_id: str) -> list[tuple]:
    """(id, site, event, message, t) of the run's newest ANNOTATED_EVENTS events, routine kinds left out."""
    marks = ",".join("?" * len(ROUTINE_EVENTS))
    return store.db.conn.execute(
        f"SELECT id, site, event, message, t FROM events WHERE run_id = ? AND event NOT IN ({marks})"
        " ORDER BY t DESC, id DESC LIMIT ?", (run_id, *ROUTINE_EVENTS, ANNOTATED_EVENTS)).fetchall()


def _one_line(message: str | None) -> str:
    line = " ".join((message or "").split())
    return line if len(line) <= MESSAGE_CHARS else line[:MESSAGE_CHARS - 3] + "..."


def serve(db_path: Path, *, port: int = DEFAULT_PORT, addr: str = "127.0.0.1", runs: Iterable[str] = ()):
    """Start the exporter in a background thread; returns the HTTP server (its port: server.server_port)."""
    from prometheus_client import start_http_server
    from prometheus_client.registry import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(db_path, runs))
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server
