"""TensorBoard: one event file per run under the run's directory (`tensorboard --load_fast=false --logdir DIR`).

Several processes collect the same run (launch --wait, watch, metrics serve), one at a time
(dilococtl.sinks.feed's lock). Each appends its batch to the same file, so the file holds the
rounds in order: one file per process would not, and TensorBoard's reader drops the points of a
file whose steps go back below what an earlier file held. The records are framed by TensorBoard's
own RecordWriter; torch is not imported.

Scalars are written as float64 tensors with the scalars plugin's metadata (TensorBoard's own v2
form), not as the float32 `simple_value`: a perplexity of 200 would otherwise lose its 5th decimal
and differ from what status shows. TensorBoard's default fast loader (its Rust data server) reads
float32 scalars only and shows none of these: `tensorboard --load_fast=false` (the README says so).
Events go to the text plugin under the tag "events".
"""

from __future__ import annotations

import time
from pathlib import Path

from dilococtl.sinks.base import EventLine, Point, RunInfo, Sink

EVENTS_TAG = "events"
FILE = "events.out.tfevents.{t}.dilococtl"  # "tfevents" in the name: what TensorBoard's loader looks for


class TensorBoardSink(Sink):
    name = "tensorboard"

    def __init__(self) -> None:
        self._path: Path | None = None

    def open(self, run: RunInfo) -> None:
        found = sorted(run.dir.glob(FILE.format(t="*")))
        self._path = found[0] if found else run.dir / FILE.format(t=int(time.time()))

    def write(self, points: list[Point], events: list[EventLine]) -> None:
        from tensorboard.compat.proto import event_pb2, types_pb2
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.summary.writer.record_writer import RecordWriter

        scalars = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="scalars"))
        text = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
        out = []
        if not self._path.exists():
            out.append(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
        for p in points:
            values = [Summary.Value(tag=tag, metadata=scalars,
                                    tensor=TensorProto(dtype=types_pb2.DT_DOUBLE, double_val=[v]))
                      for tag, v in p.values.items()]
            out.append(event_pb2.Event(wall_time=p.t, step=p.tokens, summary=Summary(value=values)))
        for e in events:
            value = Summary.Value(tag=EVENTS_TAG, metadata=text, tensor=TensorProto(
                dtype=types_pb2.DT_STRING, string_val=[e.text.encode()]))
            out.append(event_pb2.Event(wall_time=e.t, step=e.tokens, summary=Summary(value=[value])))
        writer = RecordWriter(open(self._path, "ab"))
        try:
            for ev in out:
                writer.write(ev.SerializeToString())
        finally:
            writer.close()
