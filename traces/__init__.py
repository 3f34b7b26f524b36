"""Timelines: the `Trace` model shared by predicted and measured runs, and its import/export.

Times are microseconds (float) everywhere in this package; a simulated trace with unit costs simply uses
"1 unit = 1 us".

Modules: `trace` (the model, our JSON), `names` (range names of traces.md §5), `io.load_trace` (any format, by
content), `chrome` (Chrome/Perfetto JSON in and out), `nsys` (Nsight Systems SQLite export), `nsys_csv` (`nsys
stats` NVTX CSV), `kineto` (PyTorch profiler JSON), `project` (CPU range -> GPU projection), `compare` and
`report` (predicted vs measured), `receive_wait` (waiting for messages, what both sides can compare of P2P),
`comm_overlap` (measured communication under compute), `view` and `plot` (pictures). The commands that read
and draw traces (`mhcpipe view`, `compare`, `diagnose`, `check-comm`, ...) live in the app layer (mhcpipe/).
"""
from traces.trace import STREAMS, Span, Trace, TraceError, span_name

__all__ = ["STREAMS", "Span", "Trace", "TraceError", "span_name"]
