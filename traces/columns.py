"""A trace's spans as numpy columns, for analyses that work on every span at once (issue 58: 10^6 spans).

`columns_of(trace)` gives rank, start, duration and end as arrays (index i is `trace.spans[i]`) and kind and
stream as codes into their few distinct values; it is kept on the trace (traces.trace.kept) while its span list
stays the same. end = start + duration, as Span.end computes it (the same float). The columns are made from the
Span objects when first asked for (0.3 s for 10^6 spans), not kept from a JSON file at reading: numpy arrays made
while a file's parse is alive pin ~100 MB of freed heap above them. Our .npz file holds them already: its arrays
are kept as the trace's columns (`keep_file_columns`). The analyses then select with masks instead of a Python
test per span.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from traces.trace import Trace, keep, kept


@dataclass(frozen=True)
class Columns:
    rank: np.ndarray  # int32
    start: np.ndarray  # float64
    duration: np.ndarray  # float64
    kind: np.ndarray  # int32 codes into `kinds`
    kinds: tuple[str, ...]
    stream: np.ndarray  # int32 codes into `streams`
    streams: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.rank)

    @property
    def end(self) -> np.ndarray:
        """start + duration, computed per call (not kept: 8 MB per 10^6 spans; index first where only some rows
        are needed, (start[i] + duration[i]) is the same float)."""
        return self.start + self.duration

    def take(self, idx) -> Columns:
        """The columns of the spans `idx` (a trace cut from this one: its span i is this one's idx[i])."""
        idx = np.asarray(idx, dtype=np.int64)
        return Columns(self.rank[idx], self.start[idx], self.duration[idx], self.kind[idx], self.kinds,
                       self.stream[idx], self.streams)


def columns_of(trace: Trace) -> Columns:
    return kept(trace, "_columns", lambda: _columns(trace))


def keep_columns(cut: Trace, whole: Trace, idx) -> None:
    """`cut` holds the spans `idx` of `whole`: its columns are those rows of whole's (no pass over its spans)."""
    keep(cut, "_columns", columns_of(whole).take(idx))


def keep_file_columns(trace: Trace, rank: np.ndarray, start: np.ndarray, duration: np.ndarray, kind: np.ndarray,
                      kinds: list[str], stream: np.ndarray, streams: list[str]) -> None:
    """`trace`'s columns from a file that holds them (our .npz: traces.formats.npz), its codes into `kinds` and
    `streams` numbered again in order of first appearance, as columns_of numbers them: the same Columns without a
    pass over the spans (0.25 s per 10^6 spans)."""
    # the file's arrays themselves where their dtype is the columns' (no copy: 20 bytes a span; read, never written)
    keep(trace, "_columns", Columns(rank.astype(np.int32, copy=False), start.astype(np.float64, copy=False),
                                    duration.astype(np.float64, copy=False), *_recoded(kind, kinds),
                                    *_recoded(stream, streams)))


def _recoded(codes: np.ndarray, values: list[str]) -> tuple[np.ndarray, tuple[str, ...]]:
    used, first = np.unique(codes, return_index=True)
    order = used[np.argsort(first)]  # the codes in order of first appearance
    table = np.zeros(len(values), dtype=np.int32)
    table[order] = np.arange(len(order), dtype=np.int32)
    return table[codes], tuple(values[c] for c in order.tolist())


def first_seen_codes(values: list[str]) -> tuple[np.ndarray, tuple[str, ...]]:
    """Codes into the distinct values (a few kinds or streams for 10^6 spans)."""
    index = {v: k for k, v in enumerate(dict.fromkeys(values))}
    return np.fromiter(map(index.__getitem__, values), np.int32, len(values)), tuple(index)


def _columns(trace: Trace) -> Columns:
    spans = trace.spans
    n = len(spans)
    kind, kinds = first_seen_codes(list(map(attrgetter("kind"), spans)))
    stream, streams = first_seen_codes(list(map(attrgetter("stream"), spans)))
    return Columns(np.fromiter(map(attrgetter("rank"), spans), np.int32, n),
                   np.fromiter(map(attrgetter("start"), spans), np.float64, n),
                   np.fromiter(map(attrgetter("duration"), spans), np.float64, n), kind, kinds, stream, streams)
