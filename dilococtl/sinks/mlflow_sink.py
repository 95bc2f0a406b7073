"""MLflow: one MLflow run per dilococtl run, metrics with step = tokens of all sites.

Where: [metrics] mlflow_tracking_uri, else $MLFLOW_TRACKING_URI, else a file store under the run's
directory (HOME/runs/RUN_ID/metrics/mlflow/mlruns; `mlflow ui --backend-store-uri` it). MLflow 3
refuses new file stores unless MLFLOW_ALLOW_FILE_STORE is set: a local store needs no server and no
database, so it is set for that store only. Events are text artifacts (events/FIRST_ID.txt). A
tracking server that does not answer must not hold the collector for minutes of retries: requests
time out after HTTP_TIMEOUT_S and are not retried (the sink then fails once and is off).
"""

from __future__ import annotations

import os
import time

from dilococtl.sinks.base import EventLine, Point, RunInfo, Sink

HTTP_TIMEOUT_S = 10  # seconds a request to a tracking server may take
BATCH = 1000  # MLflow's limit of metrics per log_batch


class MlflowSink(Sink):
    name = "mlflow"

    def __init__(self, *, tracking_uri: str = "", experiment: str = "dilococtl") -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self._client = None
        self._run_id = ""

    def open(self, run: RunInfo) -> None:
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
        if not uri:
            uri = (run.dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(HTTP_TIMEOUT_S))
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=uri)
        self._run_id = run.state.get("mlflow_run_id", "")
        if not self._run_id:
            exp = self._client.get_experiment_by_name(self.experiment)
            exp_id = exp.experiment_id if exp else self._client.create_experiment(self.experiment)
            made = self._client.create_run(exp_id, run_name=run.name, tags={"dilococtl.run_id": run.id})
            self._run_id = made.info.run_id
            run.state["mlflow_run_id"] = self._run_id  # saved with the state after the first write
            run.state["mlflow_tracking_uri"] = uri

    def write(self, points: list[Point], events: list[EventLine]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(key, v, int(p.t * 1000), p.tokens) for p in points for key, v in p.values.items()]
        for i in range(0, len(metrics), BATCH):
            self._client.log_batch(self._run_id, metrics=metrics[i:i + BATCH])
        if events:
            text = "".join(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(e.t))}Z tokens {e.tokens} {e.text}\n"
                           for e in events)
            self._client.log_text(self._run_id, text, f"events/{events[0].id:09d}.txt")

    def close(self) -> None:
        self._client = None
