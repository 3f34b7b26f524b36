"""`load_trace(path)`: read any supported trace file (or a folder of per-rank files) into a `Trace`.

Formats are sniffed from the content, not the name: our JSON (`format: mhc-pipe-trace`) and our binary columns
(`.npz`, traces.formats.npz), Chrome/Perfetto JSON
written by us or others, PyTorch profiler (Kineto) JSON, Nsight Systems SQLite export, `nsys stats` NVTX CSV
reports; JSON and CSV may be gzip / xz compressed. A folder loads every trace file in it and merges them
(one file per rank, e.g. `prof_%q{RANK}.sqlite` or Kineto's per-rank JSON).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from traces.formats.chrome import chrome_to_traces, pick
from traces.formats.kineto import is_kineto, json_bytes, kineto_to_trace, read_json, stream_kineto
from traces.formats.npz import MAGIC as NPZ_MAGIC, ColumnFile, load_npz, save_npz
from traces.formats.nsys import load_nsys
from traces.formats.nsys_csv import load_nsys_csv, looks_like_nsys_csv, read_text
from traces.trace import FORMAT_NAME, Trace, TraceError, validated
from traces.trace_json import opens_as_v2, validated_v2_bytes

_RANK_IN_NAME = re.compile(r"(?:rank|proc|prof)[-_]?(\d+)", re.IGNORECASE)
# pydantic's one-pass parse (trace_json.validated_v2_bytes) holds its own parse tree while it builds the lists:
# ~0.3 GB more at its peak per 10^6 spans (92 MB of JSON) than json.loads and a check of the parsed values, for
# ~0.9 s less per file. Above this size the general path's lower peak matters more (10^7 spans: 0.9 GB of JSON).
ONE_PASS_MAX_BYTES = 256 << 20
TRACE_SUFFIXES = (".json", ".json.gz", ".sqlite", ".csv", ".csv.xz", ".csv.gz", ".pt.trace.json", ".pt.trace.json.gz",
                  ".npz")


def sniff(path: Path) -> str:
    """One of: sqlite, npz, json, csv."""
    try:
        with path.open("rb") as fh:
            head = fh.read(16)
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise TraceError(f"{path}: is a directory") from None
    if head.startswith(b"SQLite format 3"):
        return "sqlite"
    if head.startswith(NPZ_MAGIC):
        return "npz"
    if head[:6] == b"\xfd7zXZ\x00" or head[:2] == b"\x1f\x8b":
        name = path.name.lower()
        return "csv" if ".csv" in name else "json"
    stripped = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if stripped[:1] in (b"{", b"["):
        return "json"
    if not head:
        raise TraceError(f"{path}: the file is empty")
    return "csv"


def load_trace(path: str | Path, rank: int | None = None, which: str | None = None) -> Trace:
    """Read a trace file or a folder of them. `rank` sets the rank of a single-process file; `which`
    ("predicted"/"measured") picks one trace from a Chrome file that holds both."""
    path = Path(path)
    if path.is_dir():
        return load_folder(path)
    kind = sniff(path)
    if kind == "npz":
        return load_npz(path)
    if kind == "sqlite":
        trace = load_nsys(path, rank=rank)
    elif kind == "csv":
        text_head = read_text(path)[:4096]
        if not looks_like_nsys_csv(text_head):
            raise TraceError(f"{path}: not a recognised trace: expected JSON (ours, Chrome/Perfetto, PyTorch "
                             "profiler), an Nsight Systems SQLite export, or an nsys stats NVTX trace CSV")
        trace = load_nsys_csv(path, rank=rank)
    else:
        trace = streamed_trace(path, rank=rank)
        return trace if trace is not None else json_file_trace(path, read_json(path), rank=rank, which=which,
                                                               consume=True)
    if rank is None:
        _rank_from_file_name(trace, path)
    return trace


def read_columns(path: str | Path, rank: int | None = None, which: str | None = None) -> ColumnFile | Trace:
    """Our .npz, or our JSON version 2, as checked columns (traces.formats.npz.ColumnFile: the analyses find the
    steps on them and make Span objects only when asked for); any other trace as load_trace reads it."""
    path = Path(path)
    kind = None if path.is_dir() else sniff(path)
    if kind == "npz":
        return ColumnFile.read(path)
    if kind != "json":
        return load_trace(path, rank, which)
    ours = one_pass_columns(path)
    if ours is not None:
        return ours
    trace = streamed_trace(path, rank=rank)
    if trace is not None:
        return trace
    data = read_json(path)
    return json_columns(data, path) or json_file_trace(path, data, rank=rank, which=which, consume=True)


def one_pass_columns(path: Path) -> ColumnFile | None:
    """Our JSON version 2 as our writer writes it, in a plain file of at most ONE_PASS_MAX_BYTES: its columns parsed
    and checked in one pass (trace_json.validated_v2_bytes); None for any other file, and for one that fails the
    check (the general path reads it again and says why, naming the field)."""
    if not _plain_v2(path):
        return None
    parsed = validated_v2_bytes(json_bytes(path))
    return None if parsed is None else ColumnFile.of_json(parsed["columns"], dict(parsed.get("meta", {})), str(path))


def _plain_v2(path: Path) -> bool:
    """Whether `path` is a plain (not compressed) file of at most ONE_PASS_MAX_BYTES that opens as our writer
    writes version 2."""
    with path.open("rb") as fh:
        head = fh.read(256)
    return opens_as_v2(head) and path.stat().st_size <= ONE_PASS_MAX_BYTES


def json_columns(data: Any, path: Path) -> ColumnFile | None:
    """Our JSON version 2, parsed (`data`, given away), as checked columns; None for any other JSON."""
    if not (isinstance(data, dict) and data.get("format") == FORMAT_NAME and data.get("version") == 2):
        return None
    _, parsed = validated(data, str(path), consume=True)
    return ColumnFile.of_json(parsed["columns"], dict(parsed.get("meta", {})), str(path))


def save_trace(trace: Trace, path: str | Path) -> Path:
    """Write `trace` as our binary columns when `path` ends in .npz, else as our JSON."""
    return save_npz(trace, path) if str(path).lower().endswith(".npz") else trace.save(path)


def streamed_trace(path: Path, rank: int | None = None) -> Trace | None:
    """A JSON file read as a stream (a PyTorch profiler trace, event by event: kineto.stream_kineto), or None
    when it is another JSON (read it whole: json_file_trace)."""
    trace = stream_kineto(path, rank=rank)
    if trace is not None and rank is None:
        _rank_from_file_name(trace, path)
    return trace


def json_file_trace(path: Path, data: Any, rank: int | None = None, which: str | None = None,
                    consume: bool = False) -> Trace:
    """load_trace of a JSON file whose content the caller has read already (`data`): a 10^6-span file is parsed
    once, not once per question about it. `consume`: the caller gives `data` away (Trace.from_dict)."""
    trace = from_json_data(data, str(path), rank=rank, which=which, file_name=path.name, consume=consume)
    if rank is None:
        _rank_from_file_name(trace, path)
    return trace


def from_json_data(data: Any, source: str, rank: int | None = None, which: str | None = None,
                   file_name: str = "", consume: bool = False) -> Trace:
    if isinstance(data, dict) and data.get("format") == FORMAT_NAME:
        return Trace.from_dict(data, source=source, consume=consume)
    if is_kineto(data):
        return kineto_to_trace(data, source=source, rank=rank, file_name=file_name)
    if isinstance(data, (dict, list)) and (isinstance(data, list) or "traceEvents" in data):
        return pick(chrome_to_traces(data, source=source), which, source)
    raise TraceError(f"{source}: JSON of unknown shape: expected our trace (format={FORMAT_NAME!r}), a "
                     "Chrome/Perfetto trace (traceEvents) or a PyTorch profiler trace")


def _rank_from_file_name(trace: Trace, path: Path) -> None:
    """Single-process files that carry no rank (nsys CSV, nsys without MPI thread names, Kineto without
    distributedInfo) take it from a `rank3` / `proc3` / `prof_3` in the file name."""
    if trace.meta.get("format") not in ("nsys-sqlite", "nsys-stats-csv", "kineto-json") or len(trace.ranks) != 1:
        return
    if trace.meta.get("format") == "kineto-json" and not trace.meta.get("rank_assumed"):
        return
    if trace.meta.get("rank_source") == "thread name":
        return
    m = _RANK_IN_NAME.search(path.name)
    if m is None:
        return
    new = int(m.group(1))
    old = trace.ranks[0]
    if new != old:
        from dataclasses import replace
        trace.spans = [replace(s, rank=new) for s in trace.spans]
    trace.meta["rank"] = new
    trace.meta["rank_assumed"] = False
    trace.meta["rank_source"] = f"file name {path.name}"


MERGED_NAMES = ("trace.json", "trace.npz")  # what a run's --trace-dir holds besides its rank<N> files: all ranks
# merged (train.trace_format)


def load_folder(folder: Path) -> Trace:
    """A run folder whatever else it holds: the run's merged trace.json or trace.npz when it is ours (its rank<N>
    files are the same spans), else every trace file merged by rank. JSON files of another kind (a run's
    diagnostics_rank<N>.json, a Flight Recorder ledger) are skipped and listed in meta["skipped"]; a file named
    like a rank's trace that is not one is an error, not a rank silently dropped."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.lower().endswith(TRACE_SUFFIXES))
    for merged in (folder / name for name in MERGED_NAMES):
        if merged not in files:
            continue
        kind = sniff(merged)
        trace = None
        if kind == "npz":
            trace = load_npz(merged)
        elif kind == "json":
            data = read_json(merged)
            if isinstance(data, dict) and data.get("format") == FORMAT_NAME:
                trace = Trace.from_dict(data, source=str(merged), consume=True)
        if trace is not None:
            trace.meta["skipped"] = [p.name for p in files if p != merged]
            return trace
    traces, names, skipped = [], [], []
    for p in files:
        try:
            traces.append(load_trace(p))
            names.append(p.name)
        except TraceError as err:
            if "JSON of unknown shape" not in str(err) or _RANK_IN_NAME.fullmatch(p.name.split(".")[0]):
                raise
            skipped.append(p.name)
    if not traces:
        extra = f" ({', '.join(skipped)} are not traces)" if skipped else ""
        raise TraceError(f"{folder}: no trace files (*.json, *.json.gz, *.sqlite, *.csv[.xz]) in this folder{extra}")
    trace = merge_ranks(traces, names, str(folder))
    trace.meta["skipped"] = skipped
    return trace


def merge_ranks(traces: list[Trace], names: list[str], source: str) -> Trace:
    """Merge per-rank traces into one. Kineto files are aligned on their absolute time origins; ranks must
    not collide."""
    seen: dict[int, str] = {}
    for t, name in zip(traces, names):
        for r in t.ranks:
            if r in seen:
                raise TraceError(f"{source}: rank {r} appears in both {seen[r]} and {name}; name per-rank files "
                                 "rank<N> or record distributedInfo.rank")
            seen[r] = name
    origins = [t.meta.get("time_origin_us") for t in traces]
    base = min((o for o in origins if isinstance(o, (int, float))), default=None)
    spans = []
    from dataclasses import replace
    for t, o in zip(traces, origins):
        shift = (o - base) if (base is not None and isinstance(o, (int, float))) else 0.0
        spans.extend(replace(s, start=s.start + shift) if shift else s for s in t.spans)
    meta = dict(traces[0].meta)
    meta["files"] = names
    meta.pop("file", None)
    if base is not None:
        meta["time_origin_us"] = base
    return Trace(spans=spans, meta=meta)


def counts(trace: Trace) -> dict[int, dict[str, int]]:
    """Per rank: ranges (named spans, convention or not), kernels, memcpys, memsets."""
    out: dict[int, dict[str, int]] = {}
    for s in trace.spans:
        c = out.setdefault(s.rank, {"ranges": 0, "kernels": 0, "memcpy": 0, "memset": 0})
        if s.kind == "kernel":
            c["kernels"] += 1
        elif s.kind in ("memcpy", "memset"):
            c[s.kind] += 1
        else:
            c["ranges"] += 1
    return dict(sorted(out.items()))
