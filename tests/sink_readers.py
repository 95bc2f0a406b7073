"""Read what each sink wrote back with the sink's own library: {series: [(x, value), ...]}.

W&B 0.31 no longer ships a Python reader of its offline files: the records are W&B's own protobuf
(wandb.proto.wandb_internal_pb2.Record), framed as a LevelDB log with a ":W&B" header; the framing
is read here (with its checksums), the records by W&B's protobuf classes.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import zlib
from pathlib import Path

from dilococtl.sinks.feed import sink_dir

_BLOCK, _HEADER = 32768, 7


def tensorboard_series(run_id: str) -> tuple[dict[str, list[tuple[int, float]]], list[str]]:
    """Scalars and event texts of the run's TensorBoard files, through TensorBoard's EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(sink_dir(run_id, "tensorboard")), size_guidance={"tensors": 0})
    acc.Reload()
    out: dict[str, list[tuple[int, float]]] = {}
    texts: list[str] = []
    for tag in acc.Tags()["tensors"]:
        for ev in acc.Tensors(tag):
            value = tensor_util.make_ndarray(ev.tensor_proto)
            if tag == "events":
                texts.append(value.item().decode())
            else:
                out.setdefault(tag, []).append((ev.step, float(value.item())))
    return out, texts


def _leveldb_records(path: str):
    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:_HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < _HEADER:  # the block's tail is padding
            pos += room
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        if kind == 0 and length == 0:
            break
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, f"bad checksum at {pos}"
        pos += _HEADER + length
        pending += chunk
        if kind in (1, 4):  # FULL, LAST
            yield pending
            pending = b""


def wandb_series(run_id: str, x: str = "tokens") -> tuple[dict[str, list[tuple[int, float]]], list[str]]:
    """History of every offline W&B run file of the run: series against `x`, and the events' texts.

    Each process that collected the run resumed the same W&B run id in its own offline directory
    (`wandb sync` them in time order); their rows are disjoint rounds, put in round order here."""
    from wandb.proto import wandb_internal_pb2 as pb

    out: dict[str, list[tuple[int, float]]] = {}
    rows: list[dict] = []
    texts: list[str] = []  # the events' text rows
    files = sorted(glob.glob(str(sink_dir(run_id, "wandb") / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert files, "no offline W&B run"
    for f in files:
        for raw in _leveldb_records(f):
            rec = pb.Record()
            rec.ParseFromString(raw)
            if rec.WhichOneof("record_type") != "history":
                continue
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item}
            if "event" in row:
                texts.append(row["event"])
            rows.append(row)
    for row in sorted(rows, key=lambda r: r.get("round", 0)):  # processes resumed the run in turn
        for key, v in row.items():
            if not key.startswith("_") and key not in (x, "round") and isinstance(v, (int, float)):
                out.setdefault(key, []).append((row[x], float(v)))
    return out, texts


def mlflow_series(run_id: str, keys: list[str]) -> dict[str, list[tuple[int, float]]]:
    """Metric histories of the run's MLflow run, through the MLflow client."""
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a file store only when told
    state = json.loads((sink_dir(run_id, "mlflow") / "state.json").read_text())
    client = MlflowClient(tracking_uri=state["mlflow_tracking_uri"])
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(state["mlflow_run_id"], k)) for k in keys}
