"""PyTorch profiler files from older releases (traces.formats.kineto): capitalised categories ("Kernel", "Operator",
"Runtime", "Memcpy", "Memset"), GPU tids given as "stream 7", no distributedInfo, record_function ranges written
as Operator events. Built here by hand in that schema (the layout of the torch-tb-profiler test traces) at the
size of the trace in the issue, and read with the right counts."""
from __future__ import annotations

import json

import pytest

from mhcpipe.cli import main
from traces.formats.io import counts, load_trace

KERNELS = 8_800


def older_trace(kernels: int = KERNELS, with_schema_version: bool = True) -> dict:
    """One ProfilerStep, forward ranges named as in traces.md §5 (as Operator events), ATen ops, and per ATen op a
    Runtime launch and its Kernel on "stream 7"; a Memcpy and a Memset per 100 kernels on "stream 12"."""
    ev = [{"ph": "X", "cat": "Operator", "name": "ProfilerStep#3", "pid": 4242, "tid": "4242", "ts": 0,
           "dur": 10 * kernels + 1000, "args": {"Input Dims": [], "External id": 1}}]
    per_range = kernels // 8
    for r in range(8):
        ev.append({"ph": "X", "cat": "Operator", "name": f"F/s0/mb{r}", "pid": 4242, "tid": "4242",
                   "ts": 10 * r * per_range + 1, "dur": 10 * per_range - 2, "args": {"External id": 2 + r}})
    corr = 1000
    for k in range(kernels):
        t = 10 * k + 2
        ev.append({"ph": "X", "cat": "Operator", "name": "aten::mm", "pid": 4242, "tid": "4242", "ts": t, "dur": 6,
                   "args": {"Input Dims": [[64, 64], [64, 64]], "External id": 100 + k}})
        ev.append({"ph": "X", "cat": "Runtime", "name": "cudaLaunchKernel", "pid": 4242, "tid": "4242", "ts": t + 1,
                   "dur": 3, "args": {"correlation": corr, "external id": 100 + k}})
        ev.append({"ph": "X", "cat": "Kernel", "name": "volta_sgemm_64x64_nn", "pid": 0, "tid": "stream 7",
                   "ts": t + 5, "dur": 4, "args": {"correlation": corr, "external id": 100 + k, "device": 0}})
        corr += 1
        if k % 100 == 0:
            for cat, name in (("Memcpy", "Memcpy HtoD (Pageable -> Device)"), ("Memset", "Memset (Device)")):
                ev.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": "stream 12", "ts": t + 6, "dur": 1,
                           "args": {"stream": 12, "correlation": corr, "device": 0}})
                corr += 1
    out = {"traceEvents": ev}
    if with_schema_version:
        out["schemaVersion"] = 1
    return out


@pytest.mark.parametrize("with_schema_version", [True, False])
def test_older_schema_loads_with_kernel_and_range_counts(tmp_path, with_schema_version):
    p = tmp_path / "worker0.pt.trace.json"
    p.write_text(json.dumps(older_trace(with_schema_version=with_schema_version)))
    t = load_trace(p)
    assert t.meta["format"] == "kineto-json" and t.meta["rank_assumed"]
    assert counts(t) == {0: {"ranges": 9, "kernels": KERNELS, "memcpy": KERNELS // 100, "memset": KERNELS // 100}}
    assert {s.stream for s in t.spans if s.kind == "kernel"} == {"cuda:7"}
    assert {s.stream for s in t.spans if s.kind in ("memcpy", "memset")} == {"cuda:12"}
    assert t.meta["older_schema_operators"] == KERNELS  # the ATen ops, skipped
    # the ranges are projected onto their kernels through the Runtime launches (traces.md §2.2)
    f0 = next(s for s in t.spans if s.label == "F/s0/mb0")
    ks = sorted(s.start for s in t.spans if s.kind == "kernel")
    assert f0.stream == "compute" and f0.start == ks[0] and f0.end == ks[KERNELS // 8 - 1] + 4
    assert next(s for s in t.spans if s.kind == "step").start == ks[0]


def test_mhcpipe_view_draws_an_older_file(tmp_path, capsys):
    p = tmp_path / "old.json"
    p.write_text(json.dumps(older_trace(kernels=400)))
    assert main(["view", str(p), "-o", str(tmp_path / "old.png")]) == 0
    assert (tmp_path / "old.png").read_bytes()[:4] == b"\x89PNG"
    assert "wrote" in capsys.readouterr().out
