"""The `Trace` model: spans with rank, stream, op kind, stage, micro-batch, start and duration.

Predicted (simulated) and measured timelines are the same type, so comparison, export and drawing share one
code path. Times are microseconds. The spans are `traces.span.Span`s; our JSON (`Trace.load`, `Trace.save`) is
`traces.trace_json`'s schema. Span, span_name, TraceError and the other names of those two modules are imported
from here too (most of the project does).

A trace the analysis commands read (our .npz or JSON version 2, as traces.formats.npz.ColumnFile) holds its rows
(`SpanRows`) and makes the Span objects only when `spans` is asked for (`Trace.of_rows`; docs/traces.md §8).
"""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict
from operator import attrgetter
from pathlib import Path
from typing import Any, Iterable, Protocol, Sequence

from traces.span import FORMAT_NAME, SPAN_FIELDS, STREAMS, Span, TraceError, collector_paused, span_name
from traces.trace_json import FORMAT_VERSION, check_columns, spans_of_columns, to_columns, validated

__all__ = ["FORMAT_NAME", "SPAN_FIELDS", "STREAMS", "Span", "SpanRows", "Trace", "TraceError", "check_columns",
           "collector_paused", "has_kept", "keep", "kept", "span_name", "union_length", "validated"]


class SpanRows(Protocol):
    """Spans held as columns elsewhere (our .npz file: traces.formats.npz), made into Span objects when asked."""

    def __len__(self) -> int: ...

    def spans(self, rows: Sequence[int] | None = None) -> list[Span]:
        """The Spans of `rows` (indices, in the order given), or of every row."""
        ...

    def field(self, name: str, rows: Sequence[int] | None = None) -> list:
        """Span field `name` of `rows` (or of every row), as the Span objects hold it."""
        ...

    def known(self, name: str, rows: Sequence[int] | None = None) -> Any:
        """Per row of `rows` (or every row), whether Span field `name` is set (not None)."""
        ...

    def ints(self, name: str, rows: Sequence[int] | None = None) -> Any:
        """Integer Span field `name` of `rows` (or every row) as an int64 array, -1 where it is None."""
        ...

    def take(self, rows: Sequence[int]) -> SpanRows:
        """The rows `rows` (in the order given) as rows of their own."""
        ...


class Trace:
    """A timeline of spans over ranks and streams, plus free-form metadata (source, schedule, units...).

    A trace read from columns (`of_rows`) makes its Span objects the first time `spans` is asked for: the analyses
    that work on columns (traces.columns) never ask, and 10^7 Span objects are ~3 GB. `span_count`, `span(i)` and
    `spans_at(idx)` answer without making them all."""

    def __init__(self, spans: list[Span] | None = None, meta: dict[str, Any] | None = None):
        self._spans: list[Span] | None = [] if spans is None else spans
        self._rows: SpanRows | None = None
        self._kept: dict[str, tuple] = {}  # kept()'s values
        self.meta: dict[str, Any] = {} if meta is None else meta

    @classmethod
    def of_rows(cls, rows: SpanRows, meta: dict[str, Any]) -> Trace:
        trace = cls(meta=meta)
        trace._spans, trace._rows = None, rows
        return trace

    @property
    def spans(self) -> list[Span]:
        if self._spans is None:
            rows = self._rows
            self._spans, self._rows = rows.spans(), None
            for name, (held, n, value) in self._kept.items():  # what was kept for the rows holds for their spans
                if held is rows:
                    self._kept[name] = (self._spans, n, value)
        return self._spans

    @spans.setter
    def spans(self, value: list[Span]) -> None:
        self._spans, self._rows = value, None

    @property
    def spans_made(self) -> bool:
        """Whether the Span objects exist (always, except for a trace read from columns not yet asked)."""
        return self._spans is not None

    @property
    def span_count(self) -> int:
        return len(self._rows) if self._spans is None else len(self._spans)

    def span(self, i: int) -> Span:
        """Span `i`, without making the others."""
        return self._rows.spans([i])[0] if self._spans is None else self._spans[i]

    def spans_at(self, idx: Sequence[int]) -> list[Span]:
        """The spans `idx`, in that order, without making the others."""
        if self._spans is None:
            return self._rows.spans(idx)
        spans = self._spans
        return [spans[i] for i in (idx.tolist() if hasattr(idx, "tolist") else idx)]

    def field(self, name: str, idx: Sequence[int] | None = None) -> list:
        """Span field `name` (`rank`, `kind`, ...) of the spans `idx` (default: every span), without making the
        Span objects."""
        if self._spans is None:
            return self._rows.field(name, idx)
        spans = self._spans if idx is None else self.spans_at(idx)
        return list(map(attrgetter(name), spans))

    def known(self, name: str, idx: Sequence[int] | None = None) -> Any:
        """Per span of `idx` (default: every span), whether its field `name` is set (not None): a bool array."""
        if self._spans is None:
            return self._rows.known(name, idx)
        import numpy as np  # here: the simulator's spans come from this module, and predict starts without numpy

        values = self.field(name, idx)
        return np.fromiter((v is not None for v in values), bool, len(values))

    def ints(self, name: str, idx: Sequence[int] | None = None) -> Any:
        """Integer Span field `name` (`rank`, `stage`, `mb`, `peer`, `batch`) of the spans `idx` (default: every
        span) as an int64 array, -1 where it is None."""
        if self._spans is None:
            return self._rows.ints(name, idx)
        import numpy as np  # (see known)

        values = self.field(name, idx)
        return np.fromiter((-1 if v is None else v for v in values), np.int64, len(values))

    def labels(self, idx: Sequence[int]) -> list[str]:
        """Span.label of the spans `idx`, without making the Span objects."""
        if self._spans is not None:
            return [s.label for s in self.spans_at(idx)]
        names = self.field("name", idx)
        unnamed = [j for j, name in enumerate(names) if not name]
        if unnamed:
            at = [idx[j] for j in unnamed]
            for j, s in zip(unnamed, self._rows.spans(at)):
                names[j] = s.label
        return names

    def subset(self, idx: Sequence[int], meta: dict[str, Any]) -> Trace:
        """The trace of the spans `idx` (in that order) with `meta`; from a trace whose Span objects are not made
        yet, one whose are not either."""
        if self._spans is None:
            return Trace.of_rows(self._rows.take(idx), meta)
        spans = self._spans
        return Trace([spans[i] for i in (idx.tolist() if hasattr(idx, "tolist") else idx)], meta)

    def __repr__(self) -> str:
        return f"Trace({self.span_count} spans, meta={self.meta!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trace):
            return NotImplemented
        return self.meta == other.meta and self.spans == other.spans

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value

    # ---- queries -------------------------------------------------------------------------------------
    @property
    def ranks(self) -> list[int]:
        return sorted(set(self.field("rank")))

    def start(self) -> float:
        return min((s.start for s in self.spans), default=0.0)

    def makespan(self) -> float:
        """End of the last span minus start of the first, over all ranks."""
        if not self.spans:
            return 0.0
        return max(s.end for s in self.spans) - self.start()

    def busy(self, stream: str = "compute") -> dict[int, float]:
        """Per-rank time covered by spans on `stream` (overlapping spans counted once)."""
        by_rank: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for s in self.spans:
            if s.stream == stream:
                by_rank[s.rank].append((s.start, s.end))
        return {r: union_length(iv) for r, iv in sorted(by_rank.items())}

    def idle(self, stream: str = "compute") -> dict[int, float]:
        """Per-rank bubble: the trace's makespan minus the rank's busy time on `stream`."""
        total = self.makespan()
        return {r: total - b for r, b in self.busy(stream).items()}

    def filter(self, **equal: Any) -> list[Span]:
        return [s for s in self.spans if all(getattr(s, k) == v for k, v in equal.items())]

    # ---- our JSON ------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Our JSON, version 2 (columns)."""
        return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "meta": self.meta, "columns": to_columns(self.spans)}

    def to_records(self) -> dict[str, Any]:
        """Our JSON, version 1 (an object per span), for readers built before version 2."""
        spans = []
        for s in self.spans:
            d = asdict(s)
            if d["partner"] is not None:
                d["partner"] = list(d["partner"])
            if d["group"] is None and d["batch"] is None:  # only measured comm spans carry them
                del d["group"], d["batch"]
            spans.append(d)
        return {"format": FORMAT_NAME, "version": 1, "meta": self.meta, "spans": spans}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict()))
        return path

    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>", consume: bool = False) -> "Trace":
        """`consume`: `data` is the caller's to give away (a file just parsed): its span lists are dropped from it
        once validated (pydantic's validated copies hold the values), so the two never need memory together with
        the spans (a 10^7-span file: ~1.5 GB less at its peak)."""
        version, parsed = validated(data, source, consume)
        with collector_paused():
            if version == 2:
                spans = spans_of_columns(parsed["columns"], source)
            else:
                unset = {"stage": None, "mb": None}  # optional on disk, positional in Span
                spans = [Span(**r) if "mb" in r and "stage" in r else Span(**(unset | r)) for r in parsed["spans"]]
        return cls(spans=spans, meta=dict(parsed.get("meta", {})))

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        path = Path(path)
        try:
            with collector_paused():
                data = json.loads(path.read_text())
        except FileNotFoundError:
            raise TraceError(f"{path}: no such file") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise TraceError(f"{path}: not valid JSON ({err}); the file may be truncated") from None
        return cls.from_dict(data, source=str(path), consume=True)

    def merged(self, others: Iterable["Trace"]) -> "Trace":
        spans = list(self.spans)
        for t in others:
            spans.extend(t.spans)
        return Trace(spans=spans, meta=dict(self.meta))


def kept(trace: Trace, name: str, make):
    """`make()`, a value derived from `trace.spans` alone, kept on the trace while its span list is the same object of
    the same length: every analysis of a loaded trace asks for the same few (compare: four times each), each a pass
    over every span. Callers read them, never change them."""
    if has_kept(trace, name):
        return trace._kept[name][2]
    value = make()
    keep(trace, name, value)
    return value


def has_kept(trace: Trace, name: str) -> bool:
    """Whether a value under `name` is kept for the trace's present span list."""
    got = trace._kept.get(name)
    return got is not None and got[0] is _held(trace) and got[1] == trace.span_count


def keep(trace: Trace, name: str, value) -> None:
    """Keep `value` under `name` on the trace for `kept`."""
    trace._kept[name] = (_held(trace), trace.span_count, value)


def _held(trace: Trace) -> Any:
    """What the trace's spans are held in now: its span list, or the rows its spans will be made from."""
    return trace._rows if trace._spans is None else trace._spans


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping (start, end) intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for a, b in sorted(intervals):
        if cur_end is None or a > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    if cur_end is not None:
        total += cur_end - cur_start
    return total

