"""`dilococtl metrics serve`: the Prometheus exporter (dilococtl/sinks/prometheus.py)."""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated

import typer

from dilococtl.cli import app
from dilococtl.cli._common import AcceptNewOpt, JsonOpt, progress

metrics_app = typer.Typer(help="Metrics for Prometheus and Grafana.", no_args_is_help=True)
app.add_typer(metrics_app, name="metrics")


@metrics_app.command("serve")
def serve(
    port: Annotated[int, typer.Option("--port", help="Port to listen on (0: any free port).")] = 9464,
    addr: Annotated[str, typer.Option("--addr", help="Address to listen on.")] = "127.0.0.1",
    run: Annotated[list[str] | None, typer.Option(
        "--run", help="Also export this run when it is no longer live (repeatable).")] = None,
    collect: Annotated[bool, typer.Option(
        "--collect/--no-collect", help="Collect from the nodes of live runs, as status does.")] = True,
    interval: Annotated[float, typer.Option("--interval", help="Seconds between collections.")] = 10.0,
    json_out: JsonOpt = False,
    accept_new: AcceptNewOpt = False,
) -> None:
    """Serve live runs' figures to Prometheus at http://ADDR:PORT/metrics until interrupted.

    Labels run and site; the numbers status and watch show. Grafana: playbooks/grafana/dilococtl.json.

    Example: dilococtl metrics serve --port 9464
    """
    from dilococtl.errors import BadInput
    from dilococtl.paths import db_path

    if not 0 <= port <= 65535:
        raise BadInput(f"--port must be in 0..65535, got {port}")
    if not 0.5 <= interval <= 3600:
        raise BadInput(f"--interval must be in [0.5, 3600] seconds, got {interval:g}")
    import importlib.util

    if importlib.util.find_spec("prometheus_client") is None:
        raise BadInput("metrics serve needs the prometheus_client package: pip install 'dilococtl[prometheus]'")
    from dilococtl.sinks.prometheus import serve as serve_exporter

    path = db_path(create=False)
    try:
        server = serve_exporter(path, port=port, addr=addr, runs=run or [])
    except OSError as e:
        raise BadInput(f"cannot listen on {addr}:{port}: {e.strerror or e}") from None
    url = f"http://{addr}:{server.server_port}/metrics"
    if json_out:
        # one line (as watch --json), flushed: a script reads the port now, while the exporter goes on serving
        sys.stdout.write(json.dumps({"url": url, "port": server.server_port, "store": str(path)}) + "\n")
        sys.stdout.flush()
    progress(f"serving {url} (Ctrl-C stops)")
    try:
        while True:
            if collect:
                _collect_live(path, accept_new)
            time.sleep(interval)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()


def _collect_live(path, accept_new: bool) -> None:
    """One refresh of every live run (as status does); a run whose nodes fail is reported, not fatal."""
    from dilococtl import runs as runs_mod
    from dilococtl.errors import DilocoError
    from dilococtl.nodes import NodePool
    from dilococtl.states import ACTIVE_RUN_STATES
    from dilococtl.store import Store

    if not path.exists():
        return
    with Store.open(path) as store:
        for r in store.list_runs():
            if r.state not in ACTIVE_RUN_STATES:
                continue
            try:
                with NodePool(r.spec().ssh, accept_new=accept_new) as pool:
                    runs_mod.refresh(r, store=store, pool=pool)
            except DilocoError as e:
                progress(f"{r.id}: {e}")
