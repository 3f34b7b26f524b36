"""PyTorch profiler (Kineto) JSON -> `Trace` (traces.md §3). Plain or gzip-compressed (`.json.gz`).

* `user_annotation` ranges (`record_function`, `ProfilerStep#K`) are projected onto GPU time through the CUDA
  runtime / driver calls inside them on the same host thread (`args.correlation` -> kernels, memcpys, memsets;
  the rule of traces.md §2.2). Where that finds nothing, the matching `gpu_user_annotation` (Kineto's own
  projection, joined on `External id`) is used; ranges that launched no GPU work keep their CPU interval on
  stream "cpu". A trace with no GPU activity at all (a CPU-only run) keeps CPU times on the logical streams.
* Names follow traces.md §5; other names are kept as kind "range" and counted in `meta["foreign_ranges"]`.
* Kernels / memcpys / memsets become spans on stream `cuda:<stream>`.
* Rank: `distributedInfo.rank` (an explicit `rank` argument overrides it); a file without it is rank 0 with
  `meta["rank_assumed"] = True`.
* Older releases (capitalised categories Kernel / Operator / Runtime / Memcpy / Memset, GPU tids "stream 7", no
  distributedInfo) read the same way: see OLD_OPERATOR below.

Timestamps: Kineto microseconds minus `meta["time_origin_us"]` (the earliest event), so spans start near 0.
"""
from __future__ import annotations

import gzip
import json
import math
import re
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from traces.names import parse_name, range_span
from traces.formats.json_stream import ObjectStream
from traces.formats.project import Launches
from traces.trace import Span, Trace, TraceError, collector_paused

GPU_OP_KINDS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset",
                "memcpy": "memcpy", "memset": "memset"}  # older releases: Kernel, Memcpy, Memset
LAUNCH_CATS = ("cuda_runtime", "cuda_driver", "runtime", "driver")  # older releases: Runtime
# Older profiler releases (PyTorch 1.8-era Kineto, the torch-tb-profiler test traces) write capitalised categories
# ("Kernel", "Operator", "Runtime", "Memcpy", "Memset"), GPU tids as strings "stream 7", no distributedInfo, and
# record_function ranges as "Operator" events like ATen ops: an Operator whose name follows traces.md §5 (or is
# ProfilerStep#K) is read as an annotation, any other Operator is an ATen op and skipped.
OLD_OPERATOR = "operator"
_STREAM_TID = re.compile(r"^\s*stream\s+(\d+)\s*$", re.IGNORECASE)


def read_json(path: str | Path) -> Any:
    """JSON from a plain or gzip file, with clear errors for missing, truncated or non-JSON files."""
    return parse_json(json_bytes(path), path)


def json_bytes(path: str | Path) -> bytes:
    """A plain or gzip file's bytes, decompressed; one-line errors for a missing file or a damaged gzip stream."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise TraceError(f"{path}: is a directory, expected a trace file") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (EOFError, OSError, zlib.error) as err:
            raise TraceError(f"{path}: gzip stream is damaged or truncated ({err}); re-copy or re-capture the "
                             "file") from None
    return raw


def parse_json(raw: bytes, path: str | Path) -> Any:
    """json_bytes' `raw` parsed (the caller passes its only reference: the bytes are gone before the parse)."""
    try:  # decoded here, as json.loads decodes bytes, so the bytes are gone before the parse: ~1 GB less at 10^7
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not UTF-8 JSON text") from None
    del raw
    try:
        with collector_paused():
            return json.loads(text)
    except json.JSONDecodeError as err:
        raise TraceError(f"{path}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno}); the file "
                         "may be truncated (was the profiler stopped before it finished writing?)") from None


KINETO_MEMBERS = frozenset({"schemaVersion", "deviceProperties", "distributedInfo"})  # the profiler writes these
# before traceEvents (schemaVersion first): a file that opens with one is read event by event (stream_kineto)


def is_kineto(data: Any) -> bool:
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        return False
    if KINETO_MEMBERS & data.keys():
        return True
    cats = {str(e.get("cat")).lower() for e in data["traceEvents"][:5000] if isinstance(e, dict)}
    return bool(cats & {"cpu_op", "kernel", "cuda_runtime", "user_annotation", "gpu_user_annotation", "operator",
                        "runtime"})


def _stream_of(args: dict, tid: Any) -> Any:
    """The CUDA stream of a GPU op: `args.stream`, else an older file's tid string "stream 7" -> 7."""
    if "stream" in args:
        return args["stream"]
    m = _STREAM_TID.match(str(tid)) if tid is not None else None
    return int(m.group(1)) if m else tid


def _num(x: Any) -> float | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)) and math.isfinite(x):
        return float(x)
    if isinstance(x, str):
        try:
            v = float(x)
        except ValueError:
            return None
        return v if math.isfinite(v) else None
    return None


def load_kineto(path: str | Path, rank: int | None = None) -> Trace:
    path = Path(path)
    trace = stream_kineto(path, rank)
    return trace if trace is not None else kineto_to_trace(read_json(path), source=str(path), rank=rank,
                                                           file_name=path.name)


def stream_kineto(path: str | Path, rank: int | None = None) -> Trace | None:
    """A PyTorch profiler file read event by event (traces.formats.json_stream: no dict per event, no whole text
    in memory), or None when the file does not open with the profiler's members (KINETO_MEMBERS) before
    traceEvents: read it whole then (json.loads; older profiler releases, other JSON)."""
    path = Path(path)
    stream = ObjectStream(path, "traceEvents", lead=KINETO_MEMBERS)
    if stream.head is None or not KINETO_MEMBERS & stream.head.keys():
        stream.close()
        return None
    return _to_trace(stream.items(), stream.members, str(path), rank, path.name)


def _file_rank(data: dict, rank: int | None) -> tuple[int, bool, str]:
    """(rank, assumed, where it came from): the argument, else the file's distributedInfo, else 0 (assumed)."""
    if rank is not None:
        return rank, False, "argument"
    file_rank = (data.get("distributedInfo") if isinstance(data.get("distributedInfo"), dict) else {}).get("rank")
    if isinstance(file_rank, int) and not isinstance(file_rank, bool) and file_rank >= 0:
        return file_rank, False, "distributedInfo"
    return 0, True, "assumed"


@dataclass
class _Events:
    """The complete events of a Kineto file that the reader uses, by role (times in the file's microseconds)."""

    gpu_ops: list = field(default_factory=list)  # (kind, ts, end, device, stream, name, correlation)
    launches: list = field(default_factory=list)  # ((pid, tid), ts, end, correlation)
    annotations: list = field(default_factory=list)  # ((pid, tid), ts, end, name, external id)
    gpu_annotations: list = field(default_factory=list)  # (ts, end, name, external id)
    bad: int = 0  # without a usable ts/dur
    old_ops: int = 0  # older schema's `operator` events that are not our ranges


def _collect(events: Iterable, source: str) -> _Events:
    out = _Events()
    for ev in events:
        if not isinstance(ev, dict) or ev.get("ph") != "X":
            continue
        raw_cat = ev.get("cat")
        cat = raw_cat.lower() if isinstance(raw_cat, str) else raw_cat
        if cat == OLD_OPERATOR:
            if parse_name(str(ev.get("name", ""))) is None:
                out.old_ops += 1
                continue
            cat = "user_annotation"
        if cat not in GPU_OP_KINDS and cat not in LAUNCH_CATS and cat not in ("user_annotation", "gpu_user_annotation"):
            continue
        ts, dur = _num(ev.get("ts")), _num(ev.get("dur"))
        if ts is None or dur is None or dur < 0:
            out.bad += 1
            continue
        args = ev.get("args") if isinstance(ev.get("args"), dict) else {}
        name = str(ev.get("name", ""))
        if cat in GPU_OP_KINDS:
            out.gpu_ops.append((GPU_OP_KINDS[cat], ts, ts + dur, args.get("device", ev.get("pid")),
                                _stream_of(args, ev.get("tid")), name, args.get("correlation")))
        elif cat in LAUNCH_CATS:
            out.launches.append(((ev.get("pid"), ev.get("tid")), ts, ts + dur, args.get("correlation")))
        elif cat == "user_annotation":
            out.annotations.append(((ev.get("pid"), ev.get("tid")), ts, ts + dur, name, args.get("External id")))
        else:
            out.gpu_annotations.append((ts, ts + dur, name, args.get("External id")))
    if not (out.gpu_ops or out.annotations or out.gpu_annotations):
        raise TraceError(f"{source}: the PyTorch profiler trace holds no annotations and no GPU activity "
                         "(was the profiler's schedule active? label spans with torch.profiler.record_function)")
    return out


def kineto_to_trace(data: Any, source: str = "<kineto>", rank: int | None = None, file_name: str = "") -> Trace:
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise TraceError(f"{source}: not a PyTorch profiler trace (expected a JSON object with a traceEvents list)")
    return _to_trace(data["traceEvents"], lambda: data, source, rank, file_name)


def _to_trace(events: Iterable, members: Callable[[], dict], source: str, rank: int | None,
              file_name: str) -> Trace:
    """The trace of a file's `events` (a list, or a stream read once); `members()`: the file's other top-level
    members, asked for once the events are read."""
    with collector_paused():  # 10^6 tuples kept: no collection passes over them while they are made
        evs = _collect(events, source)
    data = members()
    dist = data.get("distributedInfo") if isinstance(data.get("distributedInfo"), dict) else {}
    rank, rank_assumed, rank_source = _file_rank(data, rank)
    gpu_ops, launches_raw, annotations, gpu_annotations = evs.gpu_ops, evs.launches, evs.annotations, \
        evs.gpu_annotations
    bad, old_ops = evs.bad, evs.old_ops

    times = [t for _, t, *_ in gpu_ops] + [t for _, t, *_ in annotations] + [t for t, *_ in gpu_annotations]
    origin = math.floor(min(times))

    def rel(t: float) -> float:  # microseconds since the origin, rounded to the nanosecond
        return round(t - origin, 3)

    ops_by_corr: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    for _, a, b, _, _, _, corr in gpu_ops:
        if corr is not None:
            ops_by_corr[corr].append((rel(a), rel(b)))
    launches = Launches()
    for thread, a, b, corr in launches_raw:
        launches.add(thread, rel(a), rel(b), ops_by_corr.get(corr, []) if corr is not None else [])
    gpu_ann_by_ext: dict[Any, tuple[float, float]] = {}
    for a, b, _, ext in gpu_annotations:
        if ext is not None:
            prev = gpu_ann_by_ext.get(ext)
            gpu_ann_by_ext[ext] = (a, b) if prev is None else (min(prev[0], a), max(prev[1], b))
    has_gpu = bool(gpu_ops)

    spans: list[Span] = []
    foreign: Counter[str] = Counter()
    unprojected = 0
    used_ext: set[Any] = set()
    for thread, a, b, name, ext in annotations:
        parsed = parse_name(name)
        if parsed is None:
            foreign[name] += 1
        proj = launches.project(thread, rel(a), rel(b)) if has_gpu else None
        if proj is not None:
            start, end = proj.start, proj.end
        elif ext is not None and ext in gpu_ann_by_ext:
            start, end = (rel(x) for x in gpu_ann_by_ext[ext])
        else:
            start, end = rel(a), rel(b)
        if ext is not None:
            used_ext.add(ext)
        projected = proj is not None or (ext is not None and ext in gpu_ann_by_ext)
        if projected:
            stream = parsed.stream if parsed is not None else "gpu-ranges"
        else:
            stream = parsed.stream if (parsed is not None and not has_gpu) else "cpu"
            unprojected += has_gpu
        spans.append(range_span(rank, stream, parsed, name, start, round(end - start, 3)))
    for a, b, name, ext in gpu_annotations:  # GPU annotations whose CPU range is not in the file
        if ext is not None and ext in used_ext:
            continue
        parsed = parse_name(name)
        if parsed is None:
            foreign[name] += 1
        stream = parsed.stream if parsed is not None else "gpu-ranges"
        spans.append(range_span(rank, stream, parsed, name, rel(a), round(b - a, 3)))
    devices = {dev for _, _, _, dev, _, _, _ in gpu_ops}
    for kind, a, b, dev, stream_id, name, _ in gpu_ops:
        stream = f"cuda:{stream_id}" if len(devices) <= 1 else f"cuda{dev}:{stream_id}"
        spans.append(Span(rank, stream, kind, None, None, rel(a), round(b - a, 3), name=name))
    spans.sort(key=lambda s: s.start)

    meta: dict[str, Any] = {
        "source": "measured", "format": "kineto-json", "file": file_name or source, "time_unit": "us",
        "time_origin_us": origin, "time_reference": "Kineto timestamp minus time_origin_us",
        "rank": rank, "rank_assumed": rank_assumed, "rank_source": rank_source,
        "projection": "gpu (runtime correlation -> GPU ops)" if has_gpu else "none (no GPU ops; CPU times)",
        "unprojected_ranges": unprojected, "skipped_events": bad, "older_schema_operators": old_ops,
        "foreign_ranges": dict(foreign.most_common(50)), "foreign_range_count": sum(foreign.values()),
    }
    for key in ("world_size", "backend"):
        if key in dist:
            meta[key] = dist[key]
    if isinstance(data.get("schemaVersion"), (int, str)):
        meta["kineto_schema_version"] = data["schemaVersion"]
    return Trace(spans=spans, meta=meta)
