"""A trace's spans as numpy columns, for analyses that work on every span at once (issue 58: 10^6 spans).

`columns_of(trace)` gives rank, start, duration and end as arrays (index i is `trace.spans[i]`) and kind and
stream as codes into their few distinct values; it is kept on the trace (traces.trace.kept) while its span list
stays the same. end = start + duration, as Span.end computes it (the same float). A trace read from our JSON's
version 2 starts from the file's own columns (Trace.from_dict keeps them); any other span list is turned into
columns once, a pass over its attributes. The analyses then select with masks instead of a Python test per
span.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from traces.trace import Trace, keep, kept


@dataclass(frozen=True)
class Columns:
    rank: np.ndarray  # int64
    start: np.ndarray  # float64
    duration: np.ndarray  # float64
    end: np.ndarray  # float64, start + duration
    kind: np.ndarray  # int64 codes into `kinds`
    kinds: tuple[str, ...]
    stream: np.ndarray  # int64 codes into `streams`
    streams: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.rank)

    def take(self, idx) -> Columns:
        """The columns of the spans `idx` (a trace cut from this one: its span i is this one's idx[i])."""
        idx = np.asarray(idx, dtype=np.int64)
        return Columns(self.rank[idx], self.start[idx], self.duration[idx], self.end[idx], self.kind[idx], self.kinds,
                       self.stream[idx], self.streams)


def columns_of(trace: Trace) -> Columns:
    return kept(trace, "_columns", lambda: _columns(trace))


def keep_columns(cut: Trace, whole: Trace, idx) -> None:
    """`cut` holds the spans `idx` of `whole`: its columns are those rows of whole's (no pass over its spans)."""
    keep(cut, "_columns", columns_of(whole).take(idx))


def _codes(values) -> tuple[np.ndarray, tuple[str, ...]]:
    index: dict[str, int] = {}
    codes = np.fromiter((index.setdefault(v, len(index)) for v in values), np.int64)
    return codes, tuple(index)


def _columns(trace: Trace) -> Columns:
    raw = kept(trace, "_file_columns", lambda: None)
    if raw is not None:  # read from our JSON's columns (version 2): no pass over the Span objects
        start = np.asarray(raw["start"], dtype=np.float64)
        kind, stream = raw["kind"], raw["stream"]
        return Columns(np.asarray(raw["rank"], dtype=np.int64), start, np.asarray(raw["duration"], dtype=np.float64),
                       start + np.asarray(raw["duration"], dtype=np.float64),
                       np.asarray(kind["codes"], dtype=np.int64), tuple(kind["values"]),
                       np.asarray(stream["codes"], dtype=np.int64), tuple(stream["values"]))
    spans = trace.spans
    n = len(spans)
    start = np.fromiter((s.start for s in spans), np.float64, n)
    duration = np.fromiter((s.duration for s in spans), np.float64, n)
    kind, kinds = _codes(s.kind for s in spans)
    stream, streams = _codes(s.stream for s in spans)
    return Columns(np.fromiter((s.rank for s in spans), np.int64, n), start, duration, start + duration,
                   kind, kinds, stream, streams)
