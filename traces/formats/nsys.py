"""Nsight Systems SQLite export (`nsys export --type sqlite`) -> `Trace` (traces.md §2).

* NVTX push/pop and start/end ranges (`NVTX_EVENTS`, message from `text` or `textId` -> `StringIds`) are
  projected onto GPU time through the CUDA runtime calls inside each range (`correlationId` -> kernels,
  memcpys, memsets; traces.md §2.2, `traces.formats.project`). Ranges that launched nothing keep their CPU interval on
  stream "cpu"; ranges whose names do not follow the naming convention are kept as kind "range" and counted in
  `meta["foreign_ranges"]`. When the export holds no GPU work at all the convention ranges keep their CPU
  times on their logical stream (a CPU-only run).
* Every kernel / memcpy / memset becomes a span of kind "kernel" / "memcpy" / "memset" on stream
  `cuda:<streamId>` (`cuda<dev>:<streamId>` when a rank drives several GPUs), so an export without NVTX ranges
  still loads.
* Ranks: one per process. Given `rank` (single-process files, e.g. `nsys profile -o prof_%q{RANK}`), else a
  thread named `MPI Rank N` / `rank N`, else the processes in pid order.
* The schema version (`EXPORT_META_DATA` or `META_DATA_EXPORT`, row `EXPORT_SCHEMA_VERSION`) is checked and
  unknown major versions are refused; tables are resolved by name with optional `_V<n>` suffixes. The table
  `TARGET_INFO_SYSTEM_ENV` (not valid UTF-8 in real exports) is never read, and text is decoded leniently.

Timestamps: nsys nanoseconds since the session start, converted to microseconds.
"""
from __future__ import annotations

import re
import sqlite3
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from traces.names import parse_name, range_span
from traces.formats.project import Launches
from traces.trace import Span, Trace, TraceError

KNOWN_SCHEMA_MAJORS = (2, 3)
META_TABLES = ("META_DATA_EXPORT", "EXPORT_META_DATA")
PID_MASK = 0xFFFFFFFFFF000000  # globalPid = globalTid with the TID bits zeroed
RANGE_EVENT_TYPES = (59, 60, 70, 71)  # push/pop, start/end, imported NVTXT push/pop and start/end
PUSHPOP_TYPES = (59, 70)
DOMAIN_CREATE = 75
MEMCPY_KINDS = {1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD", 7: "DtoA", 8: "DtoD",
                9: "HtoH", 10: "PtoP"}
_RANK_THREAD_RE = re.compile(r"(?:MPI\s+)?rank[\s_:=#]*(\d+)", re.IGNORECASE)

REQUIRED_COLUMNS = {
    "NVTX_EVENTS": ("start", "end", "eventType", "globalTid", "text", "textId", "domainId"),
    "CUPTI_ACTIVITY_KIND_KERNEL": ("start", "end", "deviceId", "streamId", "correlationId", "globalPid"),
    "CUPTI_ACTIVITY_KIND_MEMCPY": ("start", "end", "deviceId", "streamId", "correlationId", "globalPid"),
    "CUPTI_ACTIVITY_KIND_MEMSET": ("start", "end", "deviceId", "streamId", "correlationId", "globalPid"),
    "CUPTI_ACTIVITY_KIND_RUNTIME": ("start", "end", "globalTid", "correlationId"),
    "StringIds": ("id", "value"),
}


def _lenient_text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def _connect(path: Path) -> sqlite3.Connection:
    if not path.exists():
        raise TraceError(f"{path}: no such file")
    with path.open("rb") as fh:
        if fh.read(16) != b"SQLite format 3\x00":
            raise TraceError(f"{path}: not a SQLite database; export an Nsight Systems report with "
                             "`nsys export --type sqlite REPORT.nsys-rep`")
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        con.text_factory = _lenient_text
        con.execute("SELECT name FROM sqlite_master LIMIT 1").fetchall()
    except sqlite3.DatabaseError as err:
        raise TraceError(f"{path}: cannot read as SQLite ({err}); the file may be truncated or corrupt") from None
    return con


def _resolve(tables: set[str], base: str) -> str | None:
    """`base` itself or its newest `base_V<n>` variant (newer exports add suffixes)."""
    candidates = [t for t in tables if t == base or re.fullmatch(re.escape(base) + r"_V\d+", t)]
    if not candidates:
        return None
    return max(candidates, key=lambda t: int(t.rsplit("_V", 1)[1]) if t != base else 0)


def _check_columns(con: sqlite3.Connection, path: Path, table: str, base: str) -> set[str]:
    cols = {row[1] for row in con.execute(f'PRAGMA table_info("{table}")')}
    missing = [c for c in REQUIRED_COLUMNS.get(base, ()) if c not in cols]
    if missing:
        raise TraceError(f"{path}: table {table} lacks column(s) {', '.join(missing)}; this Nsight Systems export "
                         "schema is not supported (re-export with a schema-2.x/3.x nsys, or report the version)")
    return cols


def schema_version(con: sqlite3.Connection, path: Path, tables: set[str]) -> str:
    table = next((t for t in META_TABLES if t in tables), None)
    if table is None:
        raise TraceError(f"{path}: no export metadata table ({' or '.join(META_TABLES)}), so the Nsight Systems "
                         "export schema version is unknown; re-export with `nsys export --type sqlite`")
    rows = dict(con.execute(f'SELECT name, value FROM "{table}"').fetchall())
    version = rows.get("EXPORT_SCHEMA_VERSION")
    if version is None:
        raise TraceError(f"{path}: {table} has no EXPORT_SCHEMA_VERSION row; cannot check the export schema")
    try:
        major = int(str(version).split(".")[0])
    except ValueError:
        raise TraceError(f"{path}: {table}.EXPORT_SCHEMA_VERSION = {version!r} is not a version number") from None
    if major not in KNOWN_SCHEMA_MAJORS:
        raise TraceError(f"{path}: Nsight Systems export schema version {version} is not supported (this reader "
                         f"knows major versions {', '.join(map(str, KNOWN_SCHEMA_MAJORS))}); export with a "
                         "supported nsys or use `nsys stats --report nvtx_gpu_proj_trace --format csv`")
    return str(version)


def load_nsys(path: str | Path, rank: int | None = None, domain: str | None = None) -> Trace:
    """Read an Nsight Systems SQLite export. `domain` keeps only NVTX ranges of that domain."""
    path = Path(path)
    con = _connect(path)
    try:
        return _load(con, path, rank, domain)
    except sqlite3.Error as err:
        raise TraceError(f"{path}: reading the Nsight Systems export failed ({err}); the file may be truncated "
                         "or use an unsupported schema") from None
    finally:
        con.close()


def _gpu_ops(con: sqlite3.Connection, path: Path, gpu_tables: dict, strings: dict[int, str]):
    """GPU ops: (their [start, end] by (globalPid, correlationId), for projecting launches; one row per op:
    kind, pid, device, stream, start, end, name)."""
    gpu_ops: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    op_rows: list[tuple[str, int, int, int, int, int, str]] = []  # kind, pid, dev, stream, start, end, name
    for kind, table in gpu_tables.items():
        if table is None:
            continue
        cols = _check_columns(con, path, table, f"CUPTI_ACTIVITY_KIND_{kind.upper()}")
        if kind == "kernel":
            name_col = next((c for c in ("shortName", "demangledName", "mangledName") if c in cols), None)
            extra = name_col or "NULL"
        elif kind == "memcpy":
            extra = "copyKind" if "copyKind" in cols else "NULL"
        else:
            extra = "NULL"
        q = f'SELECT globalPid, correlationId, deviceId, streamId, start, "end", {extra} FROM "{table}"'
        for gpid, corr, dev, stream, start, end, x in con.execute(q):
            if start is None or end is None:
                continue
            gpu_ops[(gpid, corr)].append((start, end))
            if kind == "kernel":
                name = strings.get(x, str(x)) if isinstance(x, int) else (x or "kernel")
            elif kind == "memcpy":
                name = f"Memcpy {MEMCPY_KINDS.get(x, x)}" if x is not None else "Memcpy"
            else:
                name = "Memset"
            op_rows.append((kind, gpid, dev, stream, start, end, name))

    return gpu_ops, op_rows


def _nvtx(con: sqlite3.Connection, path: Path, tables: set[str], t_nvtx: str | None, strings: dict[int, str]):
    """NVTX: (the ranges as (globalTid, endGlobalTid, type, start, end, text, domainId), thread names by
    globalTid, domain names by id)."""
    ranges: list[tuple] = []  # gtid, end_gtid, type, start, end, text, domainId
    thread_names: dict[int, str] = {}
    domains: dict[int, str] = {}
    if t_nvtx is not None:
        cols = _check_columns(con, path, t_nvtx, "NVTX_EVENTS")
        end_tid = "endGlobalTid" if "endGlobalTid" in cols else "NULL"
        q = (f'SELECT globalTid, {end_tid}, eventType, start, "end", text, textId, domainId FROM "{t_nvtx}"')
        for gtid, egtid, etype, start, end, text, text_id, dom in con.execute(q):
            if text is None and text_id is not None:
                text = strings.get(text_id)
            if etype == DOMAIN_CREATE:
                domains[dom] = text or ""
            elif etype == 39 and text:
                thread_names[gtid] = text
            elif etype in RANGE_EVENT_TYPES and start is not None and end is not None and gtid is not None:
                ranges.append((gtid, egtid, etype, start, end, text or "", dom))
    if "ThreadNames" in tables:
        tcols = {row[1] for row in con.execute('PRAGMA table_info("ThreadNames")')}
        if {"nameId", "globalTid"} <= tcols:
            for name_id, gtid in con.execute("SELECT nameId, globalTid FROM ThreadNames"):
                thread_names.setdefault(gtid, strings.get(name_id, ""))
    return ranges, thread_names, domains


def _load(con: sqlite3.Connection, path: Path, rank: int | None, domain: str | None) -> Trace:
    tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    t_nvtx = _resolve(tables, "NVTX_EVENTS")
    gpu_tables = {k: _resolve(tables, f"CUPTI_ACTIVITY_KIND_{k.upper()}") for k in ("kernel", "memcpy", "memset")}
    t_runtime = _resolve(tables, "CUPTI_ACTIVITY_KIND_RUNTIME")
    if t_nvtx is None and not any(gpu_tables.values()) and t_runtime is None:
        raise TraceError(f"{path}: not an Nsight Systems export (neither NVTX_EVENTS nor CUPTI_ACTIVITY_KIND_* "
                         "tables); export with `nsys export --type sqlite`, capturing with `-t cuda,nvtx`")
    version = schema_version(con, path, tables)
    strings: dict[int, str] = {}
    if "StringIds" in tables:
        _check_columns(con, path, "StringIds", "StringIds")
        strings = dict(con.execute("SELECT id, value FROM StringIds").fetchall())

    gpu_ops, op_rows = _gpu_ops(con, path, gpu_tables, strings)
    launches = Launches()
    if t_runtime is not None:
        _check_columns(con, path, t_runtime, "CUPTI_ACTIVITY_KIND_RUNTIME")
        for gtid, start, end, corr in con.execute(f'SELECT globalTid, start, "end", correlationId FROM "{t_runtime}"'):
            if start is None or end is None:
                continue
            launches.add(gtid, start, end, gpu_ops.get((gtid & PID_MASK, corr), []))

    ranges, thread_names, domains = _nvtx(con, path, tables, t_nvtx, strings)
    session_start = None
    if "TARGET_INFO_SESSION_START_TIME" in tables:
        row = con.execute("SELECT * FROM TARGET_INFO_SESSION_START_TIME LIMIT 1").fetchone()
        session_start = row[0] if row else None

    # ---- ranks -----------------------------------------------------------------------------------------
    pids = sorted({gpid for _, gpid, *_ in op_rows} | {gtid & PID_MASK for gtid, *_ in ranges})
    rank_of, rank_source = _rank_map(path, pids, thread_names, rank)
    devices_per_pid: dict[int, set[int]] = defaultdict(set)
    for _, gpid, dev, *_ in op_rows:
        devices_per_pid[gpid].add(dev)
    has_gpu = bool(op_rows)

    spans: list[Span] = []
    foreign: Counter[str] = Counter()
    unprojected = 0
    for gtid, egtid, etype, start, end, text, dom in ranges:
        if domain is not None and domains.get(dom, "") != domain:
            continue
        r = rank_of[gtid & PID_MASK]
        parsed = parse_name(text)
        same_thread = egtid is None or egtid == gtid
        proj = launches.project(gtid, start, end) if (same_thread and has_gpu) else None
        if parsed is None:
            foreign[text] += 1
        if proj is not None:
            a, b = proj.start, proj.end
            stream = parsed.stream if parsed is not None else "gpu-ranges"
        else:
            a, b = start, end
            stream = parsed.stream if (parsed is not None and not has_gpu) else "cpu"
            unprojected += has_gpu
        spans.append(range_span(r, stream, parsed, text, a / 1e3, (b - a) / 1e3))
    for kind, gpid, dev, stream_id, start, end, name in op_rows:
        stream = f"cuda:{stream_id}" if len(devices_per_pid[gpid]) <= 1 else f"cuda{dev}:{stream_id}"
        spans.append(Span(rank_of[gpid], stream, kind, None, None, start / 1e3, (end - start) / 1e3, name=name))

    meta: dict[str, Any] = {
        "source": "measured", "format": "nsys-sqlite", "file": path.name, "schema_version": version,
        "time_unit": "us", "time_reference": "Nsight Systems session start",
        "ranks": {str(r): {"pid": (p >> 24) & 0xFFFFFF} for p, r in sorted(rank_of.items(), key=lambda x: x[1])},
        "rank_source": rank_source,
        "projection": "gpu (runtime correlationId -> GPU ops)" if has_gpu else "none (no GPU ops; CPU times)",
        "unprojected_ranges": unprojected,
        "foreign_ranges": dict(foreign.most_common(50)), "foreign_range_count": sum(foreign.values()),
    }
    if session_start is not None:
        meta["session_start_utc_ns"] = int(session_start)
    if domains:
        meta["nvtx_domains"] = sorted(set(domains.values()))
    spans.sort(key=lambda s: (s.rank, s.start))
    return Trace(spans=spans, meta=meta)


def _rank_map(path: Path, pids: list[int], thread_names: dict[int, str],
              rank: int | None) -> tuple[dict[int, int], str]:
    if rank is not None:
        if len(pids) > 1:
            raise TraceError(f"{path}: holds {len(pids)} processes, so a single --rank cannot be assigned; "
                             "omit the rank (ranks then follow MPI/rank thread names or pid order)")
        return {p: rank for p in pids}, "argument"
    named: dict[int, int] = {}
    for gtid, name in thread_names.items():
        m = _RANK_THREAD_RE.search(name or "")
        if m is not None:
            named.setdefault(gtid & PID_MASK, int(m.group(1)))
    if pids and all(p in named for p in pids) and len({named[p] for p in pids}) == len(pids):
        return {p: named[p] for p in pids}, "thread name"
    return {p: i for i, p in enumerate(pids)}, "pid order"
