"""TensorBoard: event files under the run's directory (`tensorboard --logdir HOME/runs/RUN_ID/metrics`).

Scalars are written as float64 tensors with the scalars plugin's metadata (TensorBoard's own v2
form), not as the float32 `simple_value`: a perplexity of 200 would otherwise lose its 5th decimal
and differ from what status shows. Events go to the text plugin under the tag "events". The writer
is TensorBoard's own EventFileWriter; torch is not imported.
"""

from __future__ import annotations

from dilococtl.sinks.base import EventLine, Point, RunInfo, Sink

EVENTS_TAG = "events"


class TensorBoardSink(Sink):
    name = "tensorboard"

    def __init__(self) -> None:
        self._writer = None

    def open(self, run: RunInfo) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._writer = EventFileWriter(str(run.dir))

    def write(self, points: list[Point], events: list[EventLine]) -> None:
        from tensorboard.compat.proto import event_pb2, types_pb2
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto

        scalars = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="scalars"))
        text = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
        for p in points:
            values = [Summary.Value(tag=tag, metadata=scalars,
                                    tensor=TensorProto(dtype=types_pb2.DT_DOUBLE, double_val=[v]))
                      for tag, v in p.values.items()]
            self._writer.add_event(event_pb2.Event(wall_time=p.t, step=p.tokens, summary=Summary(value=values)))
        for e in events:
            value = Summary.Value(tag=EVENTS_TAG, metadata=text, tensor=TensorProto(
                dtype=types_pb2.DT_STRING, string_val=[e.text.encode()]))
            self._writer.add_event(event_pb2.Event(wall_time=e.t, step=e.tokens, summary=Summary(value=[value])))
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
