"""`nsys stats` CSV reports -> `Trace` (traces.md §2.3). Plain, `.xz` or `.gz` compressed.

* `nvtx_pushpop_trace` (columns `Start (ns)`, `End (ns)`, `Name`, `PID`, `TID`, ...): CPU-side push/pop ranges.
  They are enqueue times, not GPU times, so every span lands on stream "cpu" (compare still matches them by
  name; `meta["projection"]` says they were not projected).
* `nvtx_gpu_proj_trace` (columns `Projected Start (ns)`, `Projected Duration (ns)`, `Name`, `PID`, `TID`):
  ranges already projected onto the GPU by nsys; convention names land on their logical stream.

Names carry the NVTX domain as a prefix (`mhc_pipe:F/s3/mb7`); `traces.names.parse_name` strips it. Ranks follow
the PIDs in increasing order unless `rank` is given (single-process reports).
"""
from __future__ import annotations

import csv
import gzip
import io
import lzma
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

from traces.names import parse_name, range_span
from traces.trace import Span, Trace, TraceError

PUSHPOP_COLUMNS = ("Start (ns)", "End (ns)", "Name", "PID")
GPU_PROJ_COLUMNS = ("Projected Start (ns)", "Projected Duration (ns)", "Name", "PID")


def read_text(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    try:
        if raw[:6] == b"\xfd7zXZ\x00":
            raw = lzma.decompress(raw)
        elif raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (lzma.LZMAError, EOFError, OSError, zlib.error) as err:
        raise TraceError(f"{path}: compressed stream is damaged or truncated ({err})") from None
    return raw.decode("utf-8", errors="replace")


def looks_like_nsys_csv(head: str) -> bool:
    first = head.lstrip("\ufeff").splitlines()[0] if head.strip() else ""
    return ("Start (ns)" in first and "Name" in first) or "Projected Start (ns)" in first


def load_nsys_csv(path: str | Path, rank: int | None = None) -> Trace:
    path = Path(path)
    text = read_text(path).lstrip("\ufeff")
    reader = csv.DictReader(io.StringIO(text))
    header = reader.fieldnames or []
    if all(c in header for c in GPU_PROJ_COLUMNS):
        projected = True
    elif all(c in header for c in PUSHPOP_COLUMNS):
        projected = False
    else:
        raise TraceError(f"{path}: not an nsys stats NVTX trace CSV (need columns {', '.join(PUSHPOP_COLUMNS)} from "
                         "`nsys stats --report nvtx_pushpop_trace --format csv`, or "
                         f"{', '.join(GPU_PROJ_COLUMNS)} from nvtx_gpu_proj_trace); found {header[:6]}")
    rows: list[tuple[int, int, int, str]] = []  # pid, start ns, end ns, name
    for line_no, row in enumerate(reader, start=2):
        try:
            pid = int(row["PID"])
            if projected:
                start = int(float(row["Projected Start (ns)"]))
                end = start + int(float(row["Projected Duration (ns)"]))
            else:
                start, end = int(float(row["Start (ns)"])), int(float(row["End (ns)"]))
        except (TypeError, ValueError, KeyError):
            raise TraceError(f"{path}: line {line_no}: bad number in row {dict(list(row.items())[:4])}; the file "
                             "may be truncated") from None
        if end < start:
            raise TraceError(f"{path}: line {line_no}: range ends before it starts ({start} > {end} ns)")
        rows.append((pid, start, end, row.get("Name") or ""))
    if not rows:
        raise TraceError(f"{path}: the CSV report has a header but no ranges")
    pids = sorted({p for p, *_ in rows})
    if rank is not None and len(pids) > 1:
        raise TraceError(f"{path}: holds {len(pids)} processes, so a single rank cannot be assigned; omit it")
    rank_of = {p: (rank if rank is not None else i) for i, p in enumerate(pids)}
    spans: list[Span] = []
    foreign: Counter[str] = Counter()
    for pid, start, end, name in rows:
        parsed = parse_name(name)
        if parsed is None:
            foreign[name] += 1
            stream = "gpu-ranges" if projected else "cpu"
        else:
            stream = parsed.stream if projected else "cpu"
        spans.append(range_span(rank_of[pid], stream, parsed, name, start / 1e3, (end - start) / 1e3))
    spans.sort(key=lambda s: (s.rank, s.start))
    meta: dict[str, Any] = {
        "source": "measured", "format": "nsys-stats-csv", "file": path.name, "time_unit": "us",
        "time_reference": "Nsight Systems session start",
        "report": "nvtx_gpu_proj_trace" if projected else "nvtx_pushpop_trace",
        "projection": "gpu (projected by nsys)" if projected else "none (CPU-side push/pop ranges)",
        "ranks": {str(r): {"pid": p} for p, r in rank_of.items()},
        "rank_source": "argument" if rank is not None else "pid order",
        "foreign_ranges": dict(foreign.most_common(50)), "foreign_range_count": sum(foreign.values()),
    }
    return Trace(spans=spans, meta=meta)
