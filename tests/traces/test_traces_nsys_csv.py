"""`nsys stats` NVTX CSV reports: push/pop trace (CPU ranges) and GPU projection trace, compressed or not,
domain prefixes stripped, and clear errors."""
from __future__ import annotations

import lzma

import pytest

from traces.analysis.compare import compare
from traces.formats.io import load_trace
from traces.trace import TraceError
from traces_testlib import one_f_one_b

PUSHPOP = ("Start (ns),End (ns),Duration (ns),DurChild (ns),DurNonChild (ns),Name,PID,TID,Lvl,NumChild,RangeId,"
           "ParentId,RangeStack,NameTree\n")
GPU_PROJ = ("Name,Projected Start (ns),Projected Duration (ns),Orig Start (ns),Orig Duration (ns),Style,PID,TID,"
            "NumGPUOps,Lvl,NumChild,RangeId,ParentId,RangeStack\n")


def test_pushpop_trace_ranges_are_cpu_spans_with_ranks_per_pid(tmp_path):
    rows = ["1000,5000,4000,0,4000,mhc_pipe:F/s0/mb0,77,77,0,0,1,,:1,F/s0/mb0",
            "2000,3000,1000,0,1000,:B/s1/mb0,99,99,0,0,2,,:2,B/s1/mb0",
            "6000,7000,1000,0,1000,\"TSL:Thunk:#hlo_op=a,b#\",77,77,0,0,3,,:3,x"]
    path = tmp_path / "report_nvtx_pushpop_trace.csv.xz"
    path.write_bytes(lzma.compress((PUSHPOP + "\n".join(rows) + "\n").encode()))
    t = load_trace(path)
    assert t.meta["report"] == "nvtx_pushpop_trace" and t.meta["projection"].startswith("none")
    got = sorted((s.rank, s.kind, s.stage, s.mb, s.stream, s.start, s.duration, s.label) for s in t.spans)
    assert got == [(0, "F", 0, 0, "cpu", 1.0, 4.0, "mhc_pipe:F/s0/mb0"),
                   (0, "range", None, None, "cpu", 6.0, 1.0, "TSL:Thunk:#hlo_op=a,b#"),
                   (1, "B", 1, 0, "cpu", 2.0, 1.0, ":B/s1/mb0")]


def test_gpu_projection_report_lands_on_logical_streams_and_compares(tmp_path):
    pred = one_f_one_b(2, 2, comm=0)
    lines = [f"{s.label},{int(s.start * 1000 + 5e6)},{int(s.duration * 1100)},0,0,PushPop,{100 + s.rank},1,1,0,0,"
             f"{i},,:{i}" for i, s in enumerate(pred.spans)]
    path = tmp_path / "proj_rank.csv"
    path.write_text(GPU_PROJ + "\n".join(lines) + "\n")
    t = load_trace(path)
    assert t.meta["report"] == "nvtx_gpu_proj_trace" and t.ranks == [0, 1]
    assert {s.stream for s in t.spans} == {"compute"}
    c = compare(pred, t)
    assert c.matched == len(pred.spans)
    assert all(k.signed_median_pct == pytest.approx(100 * (1 / 1.1 - 1)) for k in c.kinds)


def test_bad_csv_inputs(tmp_path):
    wrong = tmp_path / "wrong.csv"
    wrong.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(TraceError, match="not a recognised trace"):
        load_trace(wrong)
    bad_number = tmp_path / "bad.csv"
    bad_number.write_text(PUSHPOP + "10,xx,1,0,1,F/s0/mb0,1,1,0,0,1,,:1,F\n")
    with pytest.raises(TraceError, match="bad.csv: line 2: bad number"):
        load_trace(bad_number)
    cut = tmp_path / "cut.csv.xz"
    cut.write_bytes(lzma.compress((PUSHPOP + "1,2,1,0,1,F/s0/mb0,1,1,0,0,1,,:1,F\n" * 100).encode())[:60])
    with pytest.raises(TraceError, match="cut.csv.xz: compressed stream is damaged or truncated"):
        load_trace(cut)
