"""PyTorch profiler (Kineto) reader on traces built here: projection through launches, Kineto's own GPU
annotation as fallback, CPU-only runs, ranks, gzip, folders of per-rank files, and bad input."""
from __future__ import annotations

import gzip
import json

import pytest

from traces.formats.io import load_trace
from traces.formats.kineto import load_kineto
from traces.trace import TraceError

T0 = 1_700_000_000_000_000  # absolute Kineto-style microseconds


def kineto(rank: int | None, events: list[dict], world: int = 2) -> dict:
    doc = {"schemaVersion": 1, "traceEvents": events, "displayTimeUnit": "ms"}
    if rank is not None:
        doc["distributedInfo"] = {"backend": "nccl", "rank": rank, "world_size": world}
    return doc


def ann(name, ts, dur, ext, cat="user_annotation", pid=10, tid=11):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": T0 + ts, "dur": dur,
            "args": {"External id": ext}}


def launch(ts, corr, dur=2, pid=10, tid=11):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": pid, "tid": tid, "ts": T0 + ts,
            "dur": dur, "args": {"correlation": corr, "External id": corr}}


def kernel(ts, dur, corr, stream=7, name="gemm"):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": T0 + ts, "dur": dur,
            "args": {"correlation": corr, "stream": stream, "device": 0}}


def gpu_run_events():
    return [
        ann("ProfilerStep#3", 0, 1000, 1),
        ann("F/s2/mb0", 10, 100, 2),
        launch(20, 101), launch(50, 102),
        kernel(200, 30, 101), kernel(260, 40, 102),
        ann("SEND_F/s2/mb0~comm", 120, 20, 3),
        launch(125, 103),
        kernel(400, 15, 103, stream=40, name="ncclDevKernel_SendRecv"),
        ann("B/s2/mb0", 500, 50, 4),                           # its launch is not in the file ...
        ann("B/s2/mb0", 700, 60, 4, cat="gpu_user_annotation", pid=0, tid=7),  # ... Kineto's projection is
        ann("optimizer", 900, 10, 5),                          # launches nothing: CPU time, stream "cpu"
    ]


def test_projection_through_runtime_correlation(tmp_path):
    path = tmp_path / "rank1.json"
    path.write_text(json.dumps(kineto(1, gpu_run_events())))
    t = load_kineto(path)
    assert t.ranks == [1] and t.meta["rank_source"] == "distributedInfo"
    by = {s.label: s for s in t.spans if s.kind not in ("kernel",)}
    f = by["F/s2/mb0"]
    assert (f.kind, f.stage, f.mb, f.stream, f.start, f.duration) == ("F", 2, 0, "compute", 200, 100)
    send = [s for s in t.spans if s.kind == "SEND_F"][0]
    assert (send.stream, send.start, send.duration) == ("comm", 400, 15)
    b = [s for s in t.spans if s.kind == "B"][0]
    assert (b.start, b.duration, b.stream) == (700, 60, "compute")
    opt = [s for s in t.spans if s.label == "optimizer"][0]
    assert (opt.kind, opt.stream, opt.start) == ("range", "cpu", 900)
    step = [s for s in t.spans if s.kind == "step"][0]
    assert step.stream == "step" and (step.start, step.end) == (200, 415)  # first to last kernel of the step
    assert sorted(s.stream for s in t.spans if s.kind == "kernel") == ["cuda:40", "cuda:7", "cuda:7"]
    assert t.meta["time_origin_us"] == T0 and t.meta["foreign_range_count"] == 1


def test_cpu_only_run_keeps_annotation_times_on_logical_streams(tmp_path):
    path = tmp_path / "cpu.json.gz"
    events = [ann("F/s0/mb0", 0, 100, 1), ann("SEND_F/s0/mb0~comm", 100, 5, 2), ann("step/7", 0, 200, 3)]
    path.write_bytes(gzip.compress(json.dumps(kineto(0, events)).encode()))
    t = load_trace(path)
    assert t.meta["format"] == "kineto-json"
    assert {(s.kind, s.stream, s.start, s.duration) for s in t.spans} == {
        ("F", "compute", 0, 100), ("SEND_F", "comm", 100, 5), ("step", "step", 0, 200)}


def test_missing_rank_is_assumed_and_reported(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(kineto(None, [ann("F/s0/mb0", 0, 10, 1)])))
    t = load_kineto(path)
    assert t.ranks == [0] and t.meta["rank_assumed"] is True


def test_folder_of_ranks_merges_on_absolute_time(tmp_path):
    (tmp_path / "r0.json").write_text(json.dumps(kineto(0, [ann("F/s0/mb0", 0, 10, 1)])))
    late = [dict(ann("F/s1/mb0", 0, 10, 1), ts=T0 + 25)]
    (tmp_path / "r1.json").write_text(json.dumps(kineto(1, late)))
    t = load_trace(tmp_path)
    starts = {s.rank: s.start for s in t.spans}
    assert starts == {0: 0, 1: 25}
    assert t.meta["files"] == ["r0.json", "r1.json"]


def test_folder_with_colliding_ranks_is_an_error(tmp_path):
    for name in ("a.json", "b.json"):
        (tmp_path / name).write_text(json.dumps(kineto(0, [ann("F/s0/mb0", 0, 10, 1)])))
    with pytest.raises(TraceError, match="rank 0 appears in both a.json and b.json"):
        load_trace(tmp_path)


def test_truncated_json_and_gzip_are_clear_errors(tmp_path):
    doc = json.dumps(kineto(0, gpu_run_events()))
    cut = tmp_path / "cut.json"
    cut.write_text(doc[: len(doc) // 2])
    with pytest.raises(TraceError, match=r"cut.json: not valid JSON .*truncated"):
        load_trace(cut)
    gz = gzip.compress(doc.encode())
    cutgz = tmp_path / "cut.json.gz"
    cutgz.write_bytes(gz[: len(gz) // 2])
    with pytest.raises(TraceError, match="cut.json.gz: gzip stream is damaged or truncated"):
        load_trace(cutgz)


def test_trace_without_annotations_or_gpu_work_is_an_error(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text(json.dumps(kineto(0, [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1,
                                           "ts": 1, "dur": 2}])))
    with pytest.raises(TraceError, match="no annotations and no GPU activity"):
        load_kineto(path)
