"""Communication under compute (traces.analysis.overlap_stats): hand-made timelines with known overlaps, NCCL kernels
found by
name in an imported trace, and a real Kineto trace checked against a brute-force count."""
from __future__ import annotations

import json

import numpy as np
import pytest

from mhcpipe.cli import main
from traces.formats.io import load_trace
from traces.analysis.overlap_stats import overlap_stats
from traces.trace import Span, Trace
from traces_testlib import shared_traces  # noqa: F401  (fixture)


def test_our_spans_comm_under_compute_minus_blocked_time():
    spans = [Span(0, "compute", "F", 1, 0, 0.0, 10.0),
             Span(0, "compute", "WAIT", 1, 1, 4.0, 2.0, name="WAIT/RECV_F/s0/mb1"),
             Span(0, "comm", "SEND_F", 1, 0, 5.0, 10.0, peer=1),  # [5, 15]: compute [5, 10] minus wait [5, 6]
             Span(0, "comm", "RECV_F", 0, 1, 20.0, 4.0, peer=1),  # nothing computes then
             Span(0, "cpu", "range", None, None, 0.0, 3.0, name="dataloader"),
             Span(1, "comm", "RECV_F", 1, 0, 5.0, 10.0, peer=0)]  # rank 1: comm, no compute
    o = overlap_stats(Trace(spans, {"source": "measured"}))
    assert o.basis == {0: "ops", 1: "ops"}
    assert o.per_rank[0].comm_us == 14.0 and o.per_rank[0].overlapped_us == pytest.approx(4.0)
    assert o.by_name[(0, "SEND_F")].overlap_pct == pytest.approx(40.0)
    assert o.by_name[(0, "RECV_F")].overlapped_us == 0.0
    assert o.unmatched[0] == {"range: dataloader": {"count": 1, "us": 3.0}}  # reported, not dropped
    assert any("rank 1" in n and "no compute" in n for n in o.notes)


def test_nccl_kernels_by_name_other_kernels_compute_memcpy_unmatched():
    spans = [Span(0, "cuda:7", "kernel", None, None, 0.0, 10.0, name="volta_sgemm_128x64_nn"),
             Span(0, "cuda:40", "kernel", None, None, 8.0, 4.0, name="ncclKernel_AllReduce_RING_LL_Sum_float"),
             Span(0, "cuda:40", "kernel", None, None, 20.0, 5.0, name="ncclDevKernel_SendRecv"),
             Span(0, "cuda:7", "memcpy", None, None, 12.0, 1.0, name="Memcpy HtoD"),
             Span(0, "gpu-ranges", "range", None, None, 0.0, 30.0, name="## forward ##")]
    o = overlap_stats(Trace(spans, {"source": "measured", "format": "kineto-json"}))
    assert o.basis[0] == "kernels"
    assert o.per_rank[0].spans == 2 and o.per_rank[0].overlapped_us == pytest.approx(2.0)
    assert o.per_stream[(0, "cuda:40")].overlap_pct == pytest.approx(100 * 2.0 / 9.0)
    assert set(o.unmatched[0]) == {"memcpy: Memcpy HtoD", "range: ## forward ##"}


def _brute_force(trace: Trace, res: float) -> tuple[int, float]:
    """(NCCL kernels, their time under other kernels), on a grid of `res` microseconds."""
    ks = [s for s in trace.spans if s.kind == "kernel"]
    t0 = min(s.start for s in ks)
    n = int((max(s.end for s in ks) - t0) / res) + 2
    busy = np.zeros(n, bool)
    for s in ks:
        if "nccl" not in s.name.lower():
            busy[int((s.start - t0) / res):int((s.end - t0) / res)] = True
    nccl = [s for s in ks if "nccl" in s.name.lower()]
    return len(nccl), sum(busy[int((s.start - t0) / res):int((s.end - t0) / res)].sum() * res for s in nccl)


def test_a_real_kineto_trace_agrees_with_a_brute_force_count(shared_traces, tmp_path, capsys):  # noqa: F811
    path = shared_traces / "hta_nccl_data.json.gz"
    t = load_trace(path)
    o = overlap_stats(t)
    n, under = _brute_force(t, res=0.5)
    assert o.per_rank[0].spans == n == 21  # SOURCES.md: AllReduce x 15, Broadcast x 6
    assert o.per_rank[0].overlapped_us == pytest.approx(under, rel=0.02, abs=5.0)
    assert 0.0 < o.per_rank[0].overlap_pct < 100.0
    assert main(["overlap", str(path), "--json", str(tmp_path / "o.json")]) == 0
    d = json.loads((tmp_path / "o.json").read_text())
    assert d["per_rank"]["0"]["spans"] == 21 and d["unmatched"]["0"]
    assert "Communication under compute" in capsys.readouterr().out


def test_concurrent_comm_spans_count_once_in_flight_and_each_in_span_time(capsys, tmp_path):
    """Two all-to-alls in flight together for 10 us: 20 us of span time (the share's denominator), 10 us in
    flight (what a timeline shows); the printed table names which is which."""
    spans = [Span(0, "compute", "F", 0, 0, 0.0, 10.0),
             Span(0, "comm", "A2A_DISPATCH", 0, 0, 0.0, 10.0), Span(0, "comm", "A2A_COMBINE", 0, 1, 0.0, 10.0)]
    o = overlap_stats(Trace(spans, {"source": "measured"}))
    r0 = o.per_rank[0]
    assert (r0.comm_us, r0.wall_us, r0.overlapped_us) == (20.0, 10.0, 20.0)
    path = tmp_path / "t.json"
    Trace(spans, {"source": "measured"}).save(path)
    assert main(["overlap", str(path)]) == 0
    out = capsys.readouterr().out
    assert "in flight us" in out and "span time us" in out and "comm =" not in out
