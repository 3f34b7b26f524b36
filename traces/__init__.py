"""Timelines: the `Trace` model shared by predicted and measured runs, and its import/export.

Times are microseconds (float) everywhere in this package; a simulated trace with unit costs simply uses
"1 unit = 1 us".

At the top: `span` (one timed op, its range name, TraceError), `trace` (the model), `trace_json` (our JSON's
schema), `columns` (its spans as numpy columns) and `names` (range names of traces.md §5). Below, by role: `formats`
(reading and writing Chrome/Perfetto, PyTorch profiler, Nsight Systems and Flight Recorder files; `io.load_trace`
reads any of them by content), `analysis` (steps, the dependency graph, critical path, what-if, overlap,
predicted vs measured) and `drawing` (timeline pictures, the HTML view). The commands that read and draw traces
(`mhcpipe view`, `compare`, `critical-path`, `check-comm`, ...) live in the app layer (mhcpipe/); the
stream-collapse diagnostics of a training run are read where they are written (pipeline.observability.diagnose).

`nccl_rules`: NCCL's ordering rules, the one home the strict transport and both replays share.
"""
from traces.trace import STREAMS, Span, Trace, TraceError, span_name

__all__ = ["STREAMS", "Span", "Trace", "TraceError", "span_name"]
