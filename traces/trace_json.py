"""Our JSON trace on disk (docs/traces.md §7): its schema, checked with pydantic, and the conversion between Span
objects and its columns. `traces.trace.Trace` reads and writes it through these (`Trace.load`, `Trace.save`).

Version 2 holds the spans as columns, a list per field, the few distinct streams, kinds and groups
dictionary-encoded; version 1 (an object per span) is still read. Measured at 10^6 spans
(bench/trace_scale_runs.py's file): 92 instead of 197 MB, read in 1.8 instead of 5.8 s.
"""
from __future__ import annotations

import itertools
import re
from typing import Annotated, Any

from typing_extensions import NotRequired, Required, TypedDict  # pydantic needs its TypedDict before 3.12

import pydantic

from traces.span import FORMAT_NAME, SPAN_FIELDS, Span, TraceError, collector_paused

FORMAT_VERSION = 2  # columns; version 1 (a record per span) is read too
READ_VERSIONS = (1, 2)


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
_CODED = ("stream", "kind", "group")
_DEFAULTS = {"stage": None, "mb": None, "partner": None, "peer": None, "name": "", "group": None, "batch": None}


def to_columns(spans: list[Span]) -> dict[str, Any]:
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


# how our writer opens a version-2 file (Trace.save: json.dumps of to_dict, format then version first)
_V2_HEAD = re.compile(rb'\s*\{\s*"format"\s*:\s*"' + re.escape(FORMAT_NAME.encode())
                      + rb'"\s*,\s*"version"\s*:\s*2\s*[,}]')


def opens_as_v2(head: bytes) -> bool:
    """Whether a file's first bytes (256 are enough) open as our writer opens a version-2 file."""
    return _V2_HEAD.match(head, 0, 256) is not None


def validated_v2_bytes(raw: bytes) -> dict[str, Any] | None:
    """Our JSON version 2 as UTF-8 bytes, parsed and checked against its schema in one pass (pydantic's JSON
    parser: 0.8 s instead of json.loads' 1.3 s and a second pass's 0.4 s at 10^6 spans), or None for any other
    bytes, or any that fail the check: the caller then reads them the general way (json.loads, `validated`), whose
    errors name the field; what both ways accept parses to the same values (tests/traces/test_trace_json_bytes.py)."""
    if not opens_as_v2(raw):
        return None
    with collector_paused():
        try:
            return _COLUMN_FILE.validate_json(raw)
        except (ValueError, RecursionError):  # pydantic.ValidationError is a ValueError: the general path says why
            return None


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


def spans_of_columns(cols: dict[str, Any], source: str) -> list[Span]:
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
