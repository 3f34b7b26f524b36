"""Every real third-party trace in ../shared/data/traces (SOURCES.md) loads, with the counts of ranges and
kernels per rank that SOURCES.md documents; our GPU projection agrees with Kineto's own; pictures and Chrome
exports of real files are well formed."""
from __future__ import annotations

import gzip
import json

import pytest

from traces.formats.chrome import to_chrome, validate_chrome
from traces.formats.io import counts, load_trace
from traces_testlib import shared_traces  # noqa: F401  (fixture)

# file -> (format, {rank: (ranges, kernels, memcpy, memset)}); ranges = NVTX ranges / user annotations
EXPECTED = {
    "hta_nccl_data.json.gz": ("kineto-json", {0: (42, 2700, 960, 114)}),
    "hta_sampled_rank-0.json.gz": ("kineto-json", {0: (73, 1154, 40, 10)}),
    "hta_sampled_rank-1.json.gz": ("kineto-json", {1: (65, 1104, 40, 10)}),
    "hta_rank0.json.gz": ("kineto-json", {0: (360, 6080, 1390, 277)}),
    "hta_step_based_trace_2543932.json.gz": ("kineto-json", {0: (10, 130, 10, 0)}),
    "pipit_saxpy-mpi-cuda_nsys_perlmutter0.sqlite": ("nsys-sqlite", {0: (22, 5, 15, 0)}),
    "extrap_con_kernel.sqlite": ("nsys-sqlite", {0: (0, 9, 11, 1)}),
    "pipit_nbody-nvtx_trace.csv": ("nsys-stats-csv", {0: (131, 0, 0, 0)}),
    "jaxtoolbox_pax_fsdp4_4proc_proc0_report_nvtx_pushpop_trace.csv.xz": ("nsys-stats-csv", {0: (27891, 0, 0, 0)}),
    "jaxtoolbox_pax_fsdp4_4proc_proc1_report_nvtx_pushpop_trace.csv.xz": ("nsys-stats-csv", {1: (27885, 0, 0, 0)}),
}


def test_every_shared_file_is_covered(shared_traces):  # noqa: F811
    on_disk = {p.name for p in shared_traces.iterdir() if p.name != "SOURCES.md"}
    assert on_disk == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_shared_file_loads_with_documented_counts(shared_traces, name):  # noqa: F811
    fmt, per_rank = EXPECTED[name]
    trace = load_trace(shared_traces / name)
    assert trace.meta["format"] == fmt
    got = {r: (c["ranges"], c["kernels"], c["memcpy"], c["memset"]) for r, c in counts(trace).items()}
    assert got == per_rank
    assert all(s.duration >= 0 for s in trace.spans)


def test_nsys_saxpy_projects_its_saxpy_ranges_onto_the_saxpy_kernels(shared_traces):  # noqa: F811
    t = load_trace(shared_traces / "pipit_saxpy-mpi-cuda_nsys_perlmutter0.sqlite")
    assert t.meta["schema_version"] == "2.9.1" and t.meta["rank_source"] == "thread name"
    saxpy = sorted((s.start, s.duration) for s in t.spans if s.kind == "range" and s.label == "saxpy")
    kernels = sorted((s.start, s.duration) for s in t.spans if s.kind == "kernel")
    assert len(saxpy) == 5 and saxpy == kernels       # each CPU range launched exactly its one kernel
    assert all(s.stream == "cpu" for s in t.spans if s.label.startswith("MPI_"))  # MPI calls launch nothing
    assert t.meta["foreign_ranges"] == {"MPI_Send": 10, "saxpy": 5, "MPI_Recv": 5, "MPI_Init": 1, "MPI_Finalize": 1}


def test_export_without_nvtx_loads_kernels_per_stream(shared_traces):  # noqa: F811
    t = load_trace(shared_traces / "extrap_con_kernel.sqlite")
    per_stream = {}
    for s in t.spans:
        if s.kind == "kernel":
            per_stream[s.stream] = per_stream.get(s.stream, 0) + 1
    assert per_stream == {"cuda:14": 3, "cuda:15": 2, "cuda:16": 1, "cuda:17": 1, "cuda:18": 2}
    assert {s.name for s in t.spans if s.kind == "kernel"} == {"test0", "test1", "test2", "test3", "test4"}


@pytest.mark.parametrize("name", ["hta_step_based_trace_2543932.json.gz", "hta_nccl_data.json.gz"])
def test_our_projection_agrees_with_kinetos_gpu_user_annotation(shared_traces, name):  # noqa: F811
    """Kineto's gpu_user_annotation is its own first-to-last-kernel projection; ours (runtime correlation ->
    kernels) must land on the same interval up to Kineto's ~1 us padding."""
    path = shared_traces / name
    t = load_trace(path)
    origin = t.meta["time_origin_us"]
    doc = json.loads(gzip.decompress(path.read_bytes()))
    kineto = sorted((e["name"], e["ts"] - origin, e["ts"] + e["dur"] - origin) for e in doc["traceEvents"]
                    if e.get("cat") == "gpu_user_annotation")
    ours = sorted((s.label, s.start, s.end) for s in t.spans if s.stream == "gpu-ranges")
    ours = [o for o in ours if any(o[0] == k[0] for k in kineto)]
    assert len(ours) == len(kineto) > 0
    for (kn, ka, kb), (on, oa, ob) in zip(kineto, ours):
        assert kn == on
        assert abs(ka - oa) <= 1.5 and abs(kb - ob) <= 1.5, (kn, ka, kb, oa, ob)


def test_real_traces_export_to_well_formed_chrome_json(shared_traces):  # noqa: F811
    for name in ("hta_rank0.json.gz", "extrap_con_kernel.sqlite", "pipit_nbody-nvtx_trace.csv"):
        data = to_chrome(load_trace(shared_traces / name))
        assert validate_chrome(data) == [], name


def test_two_sampled_ranks_merge_from_a_folder(shared_traces, tmp_path):  # noqa: F811
    for r in (0, 1):
        (tmp_path / f"hta_sampled_rank-{r}.json.gz").symlink_to(shared_traces / f"hta_sampled_rank-{r}.json.gz")
    t = load_trace(tmp_path)
    assert t.ranks == [0, 1]
    alone = [load_trace(tmp_path / f"hta_sampled_rank-{r}.json.gz") for r in (0, 1)]
    assert [a.meta["time_origin_us"] for a in alone] == [1682725898079292, 1682725898079484]
    # after merging, rank 1 sits on rank 0's time axis: shifted by the 192 us between the files' origins
    assert t.meta["time_origin_us"] == 1682725898079292
    assert [s.start for s in t.spans if s.rank == 0] == [s.start for s in alone[0].spans]
    assert [s.start for s in t.spans if s.rank == 1] == [s.start + 192 for s in alone[1].spans]
