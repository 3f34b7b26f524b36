"""Our trace as binary columns: a numpy `.npz` file (docs/traces.md §8), what `mhcpipe convert -o run.npz` writes
and every command reads.

    save_npz(trace, "run.npz"); ColumnFile.read("run.npz").trace()        # every span
    ColumnFile.read("run.npz").trace(rows)                               # only the spans `rows` (a step range)

The same columns as our JSON version 2 (traces.trace), as arrays: `rank`, `start`, `duration`, `stage`, `mb`,
`batch` (-1: none), `partner` (n x 2) and `peer` with a `_set` mask (their values have no sign rule), and the
fields with few distinct values dictionary-encoded as `<field>_codes` into `<field>_values` (`group_codes` -1:
none); `format`, `version` and `meta` (JSON text) as 0-d arrays. A column where every span has the default is left
out, as in JSON.

Why a second on-disk form: a 10^7-span JSON file parses into ~10^8 Python objects before a single span exists
(5 GB resident, bench/results/trace_scale_runs_1e7.json); these arrays load at disk speed, and the step
selection (traces.analysis.step_select.select_file_steps) runs on them, so Span objects are made only for the
steps asked for. Why not Parquet or Arrow: numpy is already a dependency, its format is a documented, stable
spec (NEP 1), and it reads back as data only: `allow_pickle=False` refuses object arrays, every column is checked
(dtype, shape, ranges, codes) and a forged or damaged file is refused in one line naming the column.
"""
from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from traces.columns import first_seen_codes, keep_file_columns
from traces.trace import FORMAT_NAME, SPAN_FIELDS, Span, Trace, TraceError, check_columns, collector_paused

NPZ_VERSION = 1
CHUNK = 1 << 18  # spans made at a time (ColumnFile.spans)
_CODED_FIELDS = {"stream": None, "kind": None, "name": "", "group": None}  # dictionary-encoded, and their default
MAGIC = b"PK\x03\x04"  # a zip archive (what np.savez writes)
_INT = {"rank", "stage", "mb", "peer", "batch", "stream_codes", "kind_codes", "name_codes", "group_codes"}
_FLOAT = {"start", "duration"}
_REQUIRED = {"format", "version", "rank", "stream_codes", "stream_values", "kind_codes", "kind_values", "start",
             "duration"}
_OPTIONAL = {"meta", "stage", "mb", "partner", "partner_set", "peer", "peer_set", "name_codes", "name_values",
             "group_codes", "group_values", "batch"}
_CODED = ("stream", "kind", "name", "group")


def is_npz(path: str | Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == MAGIC
    except OSError:
        return False


def _ints(values: list[int]) -> np.ndarray:
    arr = np.asarray(values, dtype=np.int64)
    small = arr.size == 0 or (arr.min() >= np.iinfo(np.int32).min and arr.max() <= np.iinfo(np.int32).max)
    return arr.astype(np.int32) if small else arr


def _coded(values: list[Any]) -> tuple[np.ndarray, list[Any]]:
    """Codes into the distinct values in first-seen order; None (a group's default) is code -1."""
    index: dict[Any, int] = {}
    codes = [-1 if v is None else index.setdefault(v, len(index)) for v in values]
    return _ints(codes), list(index)


def save_npz(trace: Trace, path: str | Path) -> Path:
    """Write `trace` as our binary columns (module docstring)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    spans = trace.spans
    cols: dict[str, np.ndarray] = {
        "format": np.array(FORMAT_NAME), "version": np.array(NPZ_VERSION), "meta": np.array(json.dumps(trace.meta)),
        "rank": _ints([s.rank for s in spans]),
        "start": np.array([s.start for s in spans], dtype=np.float64),
        "duration": np.array([s.duration for s in spans], dtype=np.float64)}
    for f in _CODED:
        values = [getattr(s, f) for s in spans]
        if (f == "name" and all(v == "" for v in values)) or (f == "group" and all(v is None for v in values)):
            continue  # every span at the default: left out
        codes, distinct = _coded(values)
        cols[f"{f}_codes"], cols[f"{f}_values"] = codes, np.array(distinct, dtype=str)
    for f in ("stage", "mb", "batch"):
        values = [getattr(s, f) for s in spans]
        if any(v is not None and v < 0 for v in values):  # -1 is how the file says none
            raise TraceError(f"{path}: field {f}: a negative value; our traces hold {f} >= 0 (or none)")
        if any(v is not None for v in values):
            cols[f] = _ints([-1 if v is None else v for v in values])
    partners = [s.partner for s in spans]
    if any(p is not None for p in partners):
        cols["partner"] = _ints([(0, 0) if p is None else p for p in partners]).reshape(len(spans), 2)
        cols["partner_set"] = np.array([p is not None for p in partners], dtype=bool)
    peers = [s.peer for s in spans]
    if any(p is not None for p in peers):
        cols["peer"] = _ints([0 if p is None else p for p in peers])
        cols["peer_set"] = np.array([p is not None for p in peers], dtype=bool)
    with path.open("wb") as fh:  # a file object: np.savez would add .npz to a path without it
        np.savez(fh, **cols)
    return path


@dataclass
class ColumnFile:
    """The checked columns of one .npz trace (module docstring): arrays of one value per span, the coded
    fields' distinct values as lists."""

    source: str
    cols: dict[str, np.ndarray]
    values: dict[str, list[str]]
    meta: dict[str, Any]

    def __len__(self) -> int:
        return len(self.cols["rank"])

    @classmethod
    def read(cls, path: str | Path) -> "ColumnFile":
        src = str(path)
        try:
            archive = np.load(path, allow_pickle=False)
        except FileNotFoundError:
            raise TraceError(f"{src}: no such file") from None
        except (zipfile.BadZipFile, ValueError, OSError, EOFError) as err:
            raise TraceError(f"{src}: not a readable .npz trace ({err}); write it again with mhcpipe convert") \
                from None
        with archive:
            names = set(archive.files)
            extra, missing = sorted(names - _REQUIRED - _OPTIONAL), sorted(_REQUIRED - names)
            if extra or missing:
                what = f"unknown column {extra[0]!r}" if extra else f"column {missing[0]!r} is missing"
                raise TraceError(f"{src}: {what}: not an mhc-pipe .npz trace (write it with mhcpipe convert)")
            cols = {}
            for name in sorted(names):
                try:
                    cols[name] = archive[name]
                except (ValueError, OSError, EOFError, zipfile.BadZipFile) as err:  # object arrays: pickles
                    raise TraceError(f"{src}: column {name}: cannot be read as plain data ({err}); the file is "
                                     "damaged or forged: write it again with mhcpipe convert") from None
        return cls._checked(src, cols)

    @classmethod
    def of_json(cls, columns: dict[str, Any], meta: dict[str, Any], source: str) -> "ColumnFile":
        """Our JSON version 2's columns, validated (traces.trace.validated), as the arrays of a .npz file, checked
        the same way: the commands then read a JSON trace as they read .npz, its Span objects made only when asked
        for. Consumes `columns` (each list dropped once it is an array)."""
        check_columns(columns, source)
        n = len(columns["rank"])
        cols: dict[str, np.ndarray] = {"format": np.array(FORMAT_NAME), "version": np.array(NPZ_VERSION),
                                       "meta": np.array(json.dumps(meta)), "rank": _ints(columns.pop("rank")),
                                       "start": np.array(columns.pop("start"), dtype=np.float64),
                                       "duration": np.array(columns.pop("duration"), dtype=np.float64)}
        for f in ("stream", "kind", "group"):  # dictionary-encoded in JSON too; a group's None becomes code -1
            col = columns.pop(f, None)
            if col is not None:
                values = col["values"]
                strings = [v for v in values if v is not None]
                table = np.array([-1 if v is None else strings.index(v) for v in values] or [0], dtype=np.int64)
                cols[f"{f}_codes"] = _ints(table[np.asarray(col["codes"], dtype=np.int64)])
                cols[f"{f}_values"] = np.array(strings, dtype=str)
        names = columns.pop("name", None)
        if names is not None:  # a few hundred distinct names: a code each, in first-seen order
            cols["name_codes"], distinct = first_seen_codes(names)
            cols["name_values"] = np.array(distinct, dtype=str)
        for f in ("stage", "mb", "batch", "peer"):  # None as NaN, then -1 (their values fit a float exactly)
            col = columns.pop(f, None)
            if col is not None:
                v = np.array(col, dtype=np.float64)
                unset = np.isnan(v)
                cols[f] = _ints(np.where(unset, -1, v).astype(np.int64))
                if f == "peer":
                    cols["peer"][unset] = 0
                    cols["peer_set"] = ~unset
        partner = columns.pop("partner", None)
        if partner is not None:  # few pairs among many None: the rows that have one, then their values
            rows = [i for i, p in enumerate(partner) if p is not None]
            pairs = np.zeros((n, 2), dtype=np.int64)
            pairs[rows] = np.array([partner[i] for i in rows], dtype=np.int64).reshape(len(rows), 2)
            cols["partner"] = _ints(pairs)
            cols["partner_set"] = np.zeros(n, dtype=bool)
            cols["partner_set"][rows] = True
        return cls._checked(source, cols)

    @classmethod
    def _checked(cls, src: str, cols: dict[str, np.ndarray]) -> "ColumnFile":
        def bad(name: str, why: str) -> TraceError:
            return TraceError(f"{src}: column {name}: {why}; the file is damaged: write it again with mhcpipe convert")

        if cols["format"].shape != () or str(cols["format"]) != FORMAT_NAME:
            raise bad("format", f"expected {FORMAT_NAME!r}")
        if cols["version"].shape != () or cols["version"].dtype.kind not in "iu" or int(cols["version"]) != NPZ_VERSION:
            raise TraceError(f"{src}: .npz trace version {cols['version'].tolist()!r} is not supported (this build "
                             f"reads version {NPZ_VERSION}): write it again with this build's mhcpipe convert")
        meta: Any = {}
        if "meta" in cols:
            try:
                meta = json.loads(str(cols["meta"])) if cols["meta"].dtype.kind == "U" else None
            except json.JSONDecodeError:
                meta = None
            if not isinstance(meta, dict):
                raise bad("meta", "expected the metadata as a JSON object")
        n = len(cols["rank"]) if cols["rank"].ndim == 1 else -1
        for name, arr in cols.items():
            if name in ("format", "version", "meta") or name.endswith("_values"):
                continue
            shape = (n, 2) if name == "partner" else (n,)
            if arr.shape != shape:
                raise bad(name, f"shape {arr.shape}, expected {shape} (one value per span, as column rank)")
            kinds, want = ("b", "bool") if name.endswith("_set") else ("f", "float") if name in _FLOAT \
                else ("iu", "integer")
            if arr.dtype.kind not in kinds:
                raise bad(name, f"dtype {arr.dtype}, expected {want}")
        values: dict[str, list[str]] = {}
        for f in _CODED:
            has_codes, has_values = f"{f}_codes" in cols, f"{f}_values" in cols
            if has_codes != has_values:
                raise bad(f"{f}_codes" if has_values else f"{f}_values", "missing its pair (codes and values)")
            if not has_codes:
                continue
            vals = cols[f"{f}_values"]
            if vals.ndim != 1 or (vals.dtype.kind != "U" and len(vals)):
                raise bad(f"{f}_values", "expected a list of strings")
            values[f] = vals.tolist()
            if f in ("stream", "kind") and any(v == "" for v in values[f]):
                raise bad(f"{f}_values", "an empty name")
            codes = cols[f"{f}_codes"]
            low = -1 if f == "group" else 0
            if len(codes) and (int(codes.min()) < low or int(codes.max()) >= len(vals)):
                raise bad(f"{f}_codes", f"a code outside {low}..{len(vals) - 1} names no value")
        for name, low in (("rank", 0), ("stage", -1), ("mb", -1), ("batch", -1)):
            if name in cols and len(cols[name]) and int(cols[name].min()) < low:
                raise bad(name, f"a value below {low}" + (" (-1: none)" if low else ""))
        for a, b in (("partner", "partner_set"), ("peer", "peer_set")):
            if (a in cols) != (b in cols):
                raise bad(a if b in cols else b, f"missing its pair ({a} and {b})")
        if not np.isfinite(cols["start"]).all():
            raise bad("start", "a value that is not a finite number")
        dur = cols["duration"]
        if not (np.isfinite(dur) & (dur >= 0)).all():
            raise bad("duration", "a value that is negative or not a finite number")
        return cls(src, cols, values, meta)

    # ---- spans ---------------------------------------------------------------------------------------
    def column(self, name: str, rows: np.ndarray | None = None) -> np.ndarray | None:
        arr = self.cols.get(name)
        return arr if arr is None or rows is None else arr[rows]

    def trace(self, rows: np.ndarray | None = None, meta: dict[str, Any] | None = None) -> Trace:
        """A Trace of every span, or of the spans `rows` (indices in file order) only, its Span objects made from
        the columns when first asked for (traces.trace.Trace.of_rows): the analyses on columns never ask."""
        rows = np.arange(len(self)) if rows is None else np.asarray(rows, dtype=np.int64)
        trace = Trace.of_rows(FileRows(self, rows), dict(self.meta if meta is None else meta))
        kind, stream = self.column("kind_codes", rows), self.column("stream_codes", rows)
        if kind is not None and stream is not None and len(rows):  # the analyses' columns, from the file's
            keep_file_columns(trace, self.column("rank", rows), self.column("start", rows),
                              self.column("duration", rows), kind, self.values["kind"], stream, self.values["stream"])
        return trace

    def spans(self, rows: np.ndarray) -> list[Span]:
        """The Spans of `rows` (indices in file order), made CHUNK at a time: the per-field lists of a chunk are
        all that exists beside the spans (10^7 spans: ~1 GB less at the peak)."""
        spans: list[Span] = []
        with collector_paused():
            for lo in range(0, len(rows), CHUNK):
                spans.extend(self._spans(rows[lo:lo + CHUNK]))
        return spans

    def field(self, name: str, rows: np.ndarray) -> list:
        """Span field `name` of the spans `rows`, as the Span objects would hold it (None for none)."""
        n = len(rows)
        if name in _CODED_FIELDS:
            codes = self.column(f"{name}_codes", rows)
            if codes is None:
                return [_CODED_FIELDS[name]] * n
            vals = self.values[name] + ([None] if name == "group" else [])  # code -1 -> None
            return list(map(vals.__getitem__, codes.tolist()))
        arr = self.column(name, rows)
        if arr is None:
            return [None] * n
        if name in ("stage", "mb", "batch"):  # -1: none
            return [None if v < 0 else v for v in arr.tolist()]
        if name in ("partner", "peer"):  # set where the mask says so
            mask = self.column(f"{name}_set", rows).tolist()
            as_tuple = name == "partner"
            return [(tuple(v) if as_tuple else v) if m else None for v, m in zip(arr.tolist(), mask)]
        return arr.tolist()

    def known(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Whether Span field `name` is set (not None) for the spans `rows`."""
        if name in _CODED_FIELDS:
            codes = self.column(f"{name}_codes", rows)
            if codes is None:
                return np.full(len(rows), _CODED_FIELDS[name] is not None)
            return codes >= 0
        if name in ("partner", "peer"):
            mask = self.column(f"{name}_set", rows)
            return np.zeros(len(rows), dtype=bool) if mask is None else mask
        arr = self.column(name, rows)
        if arr is None:
            return np.zeros(len(rows), dtype=bool)
        return arr >= 0 if name in ("stage", "mb", "batch") else np.ones(len(rows), dtype=bool)

    def ints(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Integer Span field `name` of the spans `rows` as int64, -1 where it is None."""
        if name not in ("rank", "stage", "mb", "peer", "batch"):
            raise ValueError(f"field {name!r} is not an integer field")
        arr = self.column(name, rows)
        if arr is None:
            return np.full(len(rows), -1, dtype=np.int64)
        arr = arr.astype(np.int64)
        return np.where(self.column("peer_set", rows), arr, -1) if name == "peer" else arr

    def _spans(self, rows: np.ndarray):
        return map(Span, *(self.field(name, rows) for name in SPAN_FIELDS))


@dataclass(frozen=True, eq=False)  # rows of a file: compared by identity
class FileRows:
    """Rows `rows` of a ColumnFile as a trace's spans to be made (traces.trace.SpanRows): span i is row rows[i]."""

    file: ColumnFile
    rows: np.ndarray  # int64 indices in file order

    def __len__(self) -> int:
        return len(self.rows)

    def spans(self, rows: Sequence[int] | None = None) -> list[Span]:
        return self.file.spans(self._rows(rows))

    def field(self, name: str, rows: Sequence[int] | None = None) -> list:
        return self.file.field(name, self._rows(rows))

    def known(self, name: str, rows: Sequence[int] | None = None) -> np.ndarray:
        return self.file.known(name, self._rows(rows))

    def ints(self, name: str, rows: Sequence[int] | None = None) -> np.ndarray:
        return self.file.ints(name, self._rows(rows))

    def _rows(self, rows: Sequence[int] | None) -> np.ndarray:
        return self.rows if rows is None else self.rows[np.asarray(rows, dtype=np.int64)]

    def take(self, rows: Sequence[int]) -> FileRows:
        return FileRows(self.file, self.rows[np.asarray(rows, dtype=np.int64)])


def load_npz(path: str | Path) -> Trace:
    return ColumnFile.read(path).trace()
