"""Timelines: the `Trace` model shared by predicted and measured runs, and its import/export.

Times are microseconds (float) everywhere in this package; a simulated trace with unit costs simply uses
"1 unit = 1 us".
"""
from traces.trace import STREAMS, Span, Trace, TraceError, span_name

__all__ = ["STREAMS", "Span", "Trace", "TraceError", "span_name"]
