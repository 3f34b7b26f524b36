"""The `Trace` model: spans with rank, stream, op kind, stage, micro-batch, start and duration.

Predicted (simulated) and measured timelines are the same type, so comparison, export and drawing share one
code path. Times are microseconds. The JSON schema of our own files is checked with pydantic on load; in-memory
spans are plain slotted dataclasses because simulations create 10^5-10^6 of them.

Our JSON (docs/traces.md §7): version 2 holds the spans as columns, a list per field, the few distinct streams,
kinds and groups dictionary-encoded; version 1 (an object per span) is still read. Measured at 10^6 spans
(bench/trace_scale_runs.py's file): 92 instead of 197 MB, read in 1.8 instead of 5.8 s.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import json
from collections import defaultdict
from operator import attrgetter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any, Iterable, Protocol, Sequence

from typing_extensions import NotRequired, Required, TypedDict  # pydantic needs its TypedDict before 3.12

import pydantic

# Logical streams of one rank. "hp" is the high-priority compute stream (mHC post+res of MLP sub-layers).
STREAMS = ("compute", "hp", "comm")
FORMAT_NAME = "mhc-pipe-trace"
FORMAT_VERSION = 2  # columns; version 1 (a record per span) is read too
READ_VERSIONS = (1, 2)


class TraceError(ValueError):
    """A trace file or trace value is malformed; the message names the field and the fix."""


def span_name(kind: str, stage: int | None, mb: int | None, partner: tuple[int, int] | None = None,
              stream: str = "compute", part: str | None = None) -> str:
    """The range name of traces.md §5, e.g. `F/s3/mb7`, `FB/s3/mb7+s4/mb2`, `SEND_F/s3/mb7~comm`; `part`: a piece
    of the op, `L12.post_res` in `F/s3/mb7/L12.post_res~hp`. The one place the runtime and the readers build
    names (traces.names.parse_name reads them back)."""
    if stage is None or mb is None:
        name = kind
    else:
        name = f"{kind}/s{stage}/mb{mb}"
        if partner is not None:
            name += f"+s{partner[0]}/mb{partner[1]}"
    if part is not None:
        name += f"/{part}"
    if stream != "compute":
        name += f"~{stream}"
    return name


@dataclass(slots=True)
class Span:
    """One timed operation on one rank's stream.

    kind: schedule op kind (F, I, W, B, FB, SEND_F, RECV_F, SEND_B, RECV_B) or another label (RC, OPT, a kernel).
    stage, mb: the (global stage, micro-batch) the op belongs to; for FB the forward half.
    partner: for FB, the (stage, mb) of the backward half.
    peer: for SEND/RECV, the other rank (global rank in measured traces).
    group, batch: for a measured communication span, the process group's name (the same on all its members, one
    per communicator) and the op's batch on that group (per rank, increasing in posting order; the ops of one
    batch_isend_irecv share it), so that `traces.analysis.comm_replay` can replay the posting order under NCCL's rules.
    Not frozen: a frozen dataclass constructs ~5x slower, and simulations create 10^5-10^6 spans; treat spans
    as values (use dataclasses.replace) all the same.
    """

    rank: int
    stream: str
    kind: str
    stage: int | None
    mb: int | None
    start: float
    duration: float
    partner: tuple[int, int] | None = None
    peer: int | None = None
    name: str = ""
    group: str | None = None
    batch: int | None = None

    @property
    def end(self) -> float:
        return self.start + self.duration

    @property
    def label(self) -> str:
        return self.name or span_name(self.kind, self.stage, self.mb, self.partner, self.stream)


class _SpanRecord(TypedDict, total=False):
    """On-disk schema of one span (our JSON format). A TypedDict, not a model: pydantic checks 10^6 of them in
    a third of a model's time and hands back dicts that become Spans directly (an absent optional field takes the
    Span's default)."""

    __pydantic_config__ = pydantic.ConfigDict(extra="forbid")  # type: ignore[misc]
    rank: Required[Annotated[int, pydantic.Field(ge=0)]]  # pipeline rank
    stream: Required[Annotated[str, pydantic.Field(min_length=1)]]  # logical stream: compute, hp or comm
    kind: Required[Annotated[str, pydantic.Field(min_length=1)]]  # op kind, e.g. F, I, W, B, FB, SEND_F
    stage: Annotated[int | None, pydantic.Field(ge=0)]
    mb: Annotated[int | None, pydantic.Field(ge=0)]
    start: Required[float]  # start time in microseconds
    duration: Required[Annotated[float, pydantic.Field(ge=0)]]  # duration in microseconds
    partner: tuple[int, int] | None
    peer: int | None
    name: str
    group: str | None  # comm spans: the process group's name
    batch: Annotated[int | None, pydantic.Field(ge=0)]  # comm spans: batch number on the group, per rank, in order


class _TraceFile(TypedDict):
    __pydantic_config__ = pydantic.ConfigDict(extra="forbid")  # type: ignore[misc]
    format: str
    version: int
    meta: NotRequired[dict[str, Any]]
    spans: list[_SpanRecord]


_TRACE_FILE = pydantic.TypeAdapter(_TraceFile)

NonNegInt = Annotated[int, pydantic.Field(ge=0)]
Text = Annotated[str, pydantic.Field(min_length=1)]


class _Coded(TypedDict):
    """A dictionary-encoded column: value i of the column is values[codes[i]]."""

    __pydantic_config__ = pydantic.ConfigDict(extra="forbid")  # type: ignore[misc]
    values: list[Text]
    codes: list[NonNegInt]


class _CodedGroup(TypedDict):
    __pydantic_config__ = pydantic.ConfigDict(extra="forbid")  # type: ignore[misc]
    values: list[str | None]
    codes: list[NonNegInt]


class _Columns(TypedDict, total=False):
    """Version 2: one list per Span field (absent optional columns: every span at the Span's default)."""

    __pydantic_config__ = pydantic.ConfigDict(extra="forbid")  # type: ignore[misc]
    rank: Required[list[NonNegInt]]
    stream: Required[_Coded]
    kind: Required[_Coded]
    stage: list[NonNegInt | None]
    mb: list[NonNegInt | None]
    start: Required[list[float]]
    duration: Required[list[Annotated[float, pydantic.Field(ge=0)]]]
    partner: list[tuple[int, int] | None]
    peer: list[int | None]
    name: list[str]
    group: _CodedGroup
    batch: list[NonNegInt | None]


class _ColumnFile(TypedDict):
    __pydantic_config__ = pydantic.ConfigDict(extra="forbid")  # type: ignore[misc]
    format: str
    version: int
    meta: NotRequired[dict[str, Any]]
    columns: _Columns


_COLUMN_FILE = pydantic.TypeAdapter(_ColumnFile)
SPAN_FIELDS = ("rank", "stream", "kind", "stage", "mb", "start", "duration", "partner", "peer", "name", "group",
               "batch")  # Span's fields, in order
_CODED = ("stream", "kind", "group")
_DEFAULTS = {"stage": None, "mb": None, "partner": None, "peer": None, "name": "", "group": None, "batch": None}


@contextlib.contextmanager
def collector_paused():
    """Reading a trace allocates millions of objects and no cycles: without this the cyclic collector walks the
    growing heap again and again (10^6 Spans built in 2.4 s instead of 0.44 s, measured)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _columns(spans: list[Span]) -> dict[str, Any]:
    cols: dict[str, Any] = {}
    for f in SPAN_FIELDS:
        values = [getattr(s, f) for s in spans]
        if f in _DEFAULTS and all(v == _DEFAULTS[f] for v in values):
            continue  # every span at the default: the column is left out
        if f in _CODED:
            index: dict[Any, int] = {}
            codes = [index.setdefault(v, len(index)) for v in values]
            values = {"values": list(index), "codes": codes}
        elif f == "partner":
            values = [None if p is None else list(p) for p in values]
        cols[f] = values
    return cols


SPAN_CHUNK = 1 << 18  # spans made per piece while the columns are cut down behind them


def validated(data: Any, source: str, consume: bool = False) -> tuple[int, dict[str, Any]]:
    """(version, the file's content checked against its schema) of our JSON trace `data`; `consume`: Trace.from_dict.
    A file that is not ours, of a version this build does not read, or off its schema: TraceError naming the field."""
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise TraceError(f"{source}: not an mhc-pipe trace (expected top-level field format={FORMAT_NAME!r}); "
                         "for Chrome/Perfetto JSON use traces.formats.chrome.load_chrome")
    version = data.get("version")
    if version not in READ_VERSIONS:
        raise TraceError(f"{source}: trace format version {version!r} is not supported (this build reads "
                         f"versions {', '.join(map(str, READ_VERSIONS))})")
    with collector_paused():
        try:
            parsed = (_COLUMN_FILE if version == 2 else _TRACE_FILE).validate_python(data)
        except pydantic.ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise TraceError(f"{source}: field {where}: {first['msg']}") from None
    if consume:
        data.pop("columns" if version == 2 else "spans", None)
    return version, parsed


def check_columns(cols: dict[str, Any], source: str) -> None:
    """What pydantic does not check in validated version-2 columns: one value per span in every column, every code
    naming a value."""
    n = len(cols["rank"])
    for f in SPAN_FIELDS:
        col = cols.get(f)
        if col is None:
            continue
        rows = col
        if f in _CODED:
            values, rows = col["values"], col["codes"]
            if rows and max(rows) >= len(values):
                raise TraceError(f"{source}: field columns.{f}.codes: code {max(rows)} names no value (the column "
                                 f"has {len(values)}); the file is damaged: write it again")
        if len(rows) != n:
            raise TraceError(f"{source}: field columns.{f}: {len(rows)} values for {n} spans (columns.rank); every "
                             "column has one value per span: the file is damaged, write it again")


def _spans_from_columns(cols: dict[str, Any], source: str) -> list[Span]:
    """The spans of validated version-2 columns, which this consumes: the spans are made a chunk at a time from the
    end, each chunk's rows then cut off the column lists, so the columns and the spans never need memory in full
    together (~0.7 GB less at 10^7 spans)."""
    check_columns(cols, source)
    n = len(cols["rank"])
    lists: dict[str, Any] = {f: cols.get(f) for f in SPAN_FIELDS}
    pieces: list[list[Span]] = []
    end = n
    while end > 0:
        begin = max(0, end - SPAN_CHUNK)
        args = []
        for f in SPAN_FIELDS:
            col = lists[f]
            if col is None:
                args.append(itertools.repeat(_DEFAULTS[f], end - begin))
            elif f in _CODED:
                args.append(map(col["values"].__getitem__, col["codes"][begin:end]))
            else:
                args.append(col[begin:end])
        pieces.append(list(map(Span, *args)))
        for f in SPAN_FIELDS:
            col = lists[f]
            if col is not None:
                del (col["codes"] if f in _CODED else col)[begin:]
        end = begin
    return list(itertools.chain.from_iterable(reversed(pieces)))


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
        return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "meta": self.meta, "columns": _columns(self.spans)}

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
                spans = _spans_from_columns(parsed["columns"], source)
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
