"""Nsight Systems SQLite reader on exports built here with the nsys schema (projection rule, name paths,
schema gate, ranks) and its clear errors on bad input."""
from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from traces.formats.nsys import PID_MASK, load_nsys
from traces.trace import TraceError

HW = 1 << 56  # real globalTids carry hardware/VM bits above the pid


def gtid(pid: int, tid: int) -> int:
    return HW | (pid << 24) | tid


class Export:
    """A minimal Nsight Systems SQLite export (the columns of traces.md §2.1)."""

    def __init__(self, path: Path, meta_table: str = "META_DATA_EXPORT", version: str = "3.11.1",
                 kernel_table: str = "CUPTI_ACTIVITY_KIND_KERNEL", nvtx: bool = True):
        self.path = path
        self.con = sqlite3.connect(path)
        c = self.con
        c.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL)")
        if meta_table:
            c.execute(f"CREATE TABLE {meta_table} (name TEXT, value TEXT)")
            c.execute(f"INSERT INTO {meta_table} VALUES ('EXPORT_SCHEMA_VERSION', ?)", (version,))
        if nvtx:
            c.execute("CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL, "
                      "rangeId INTEGER, category INTEGER, color INTEGER, text TEXT, globalTid INTEGER, "
                      "endGlobalTid INTEGER, textId INTEGER, domainId INTEGER, uint64Value INTEGER, "
                      "int64Value INTEGER, doubleValue REAL, uint32Value INTEGER, int32Value INTEGER, "
                      "floatValue REAL, jsonTextId INTEGER, jsonText TEXT)")
        c.execute(f"CREATE TABLE {kernel_table} (start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER, "
                  "contextId INTEGER, streamId INTEGER, correlationId INTEGER, globalPid INTEGER, "
                  "demangledName INTEGER, shortName INTEGER, mangledName INTEGER)")
        c.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER NOT NULL, end INTEGER NOT NULL, "
                  "eventClass INTEGER, globalTid INTEGER, correlationId INTEGER, nameId INTEGER, "
                  "returnValue INTEGER, callchainId INTEGER)")
        c.execute("CREATE TABLE ThreadNames (nameId INTEGER, priority INTEGER, globalTid INTEGER)")
        self.kernel_table = kernel_table
        self._sid = 0

    def string(self, value: str) -> int:
        self._sid += 1
        self.con.execute("INSERT INTO StringIds VALUES (?, ?)", (self._sid, value))
        return self._sid

    def range(self, tid: int, start: int, end: int | None, name: str, registered: bool = False,
              event_type: int = 59, end_tid: int | None = None, domain: int = 0) -> None:
        text, text_id = (None, self.string(name)) if registered else (name, None)
        self.con.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid, endGlobalTid, textId, "
                         "domainId) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                         (start, end, event_type, text, tid, end_tid, text_id, domain))

    def launch(self, tid: int, start: int, end: int, corr: int) -> None:
        self.con.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, 0, ?, ?, 1, 0, NULL)",
                         (start, end, tid, corr))

    def kernel(self, pid_of: int, start: int, end: int, corr: int, stream: int = 7, name: str = "gemm") -> None:
        sid = self.string(name)
        self.con.execute(f"INSERT INTO {self.kernel_table} VALUES (?, ?, 0, 1, ?, ?, ?, ?, ?, ?)",
                         (start, end, stream, corr, pid_of & PID_MASK, sid, sid, sid))

    def thread_name(self, tid: int, name: str) -> None:
        self.con.execute("INSERT INTO ThreadNames VALUES (?, 10, ?)", (self.string(name), tid))

    def close(self) -> Path:
        self.con.commit()
        self.con.close()
        return self.path


def test_range_projects_onto_the_span_of_the_kernels_it_launched(tmp_path):
    t = gtid(100, 101)
    other_thread = gtid(100, 102)
    ex = Export(tmp_path / "a.sqlite")
    ex.range(t, 1_000_000, 2_000_000, "F/s3/mb7")                       # CPU window 1000..2000 us
    ex.range(t, 1_000_500, 1_300_000, "F/s3/mb7/L0.post_res~hp", registered=True)  # nested: first launch only
    ex.launch(t, 1_100_000, 1_110_000, corr=1)
    ex.launch(t, 1_500_000, 1_510_000, corr=2)
    ex.launch(t, 1_990_000, 2_010_000, corr=3)                          # ends after the range: not inside
    ex.launch(other_thread, 1_600_000, 1_610_000, corr=4)               # inside in time, other thread
    ex.kernel(t, 3_000_000, 4_000_000, corr=1)
    ex.kernel(t, 4_500_000, 5_000_000, corr=2, stream=9)
    ex.kernel(t, 6_000_000, 7_000_000, corr=3)
    ex.kernel(t, 8_000_000, 9_000_000, corr=4)
    ex.kernel(gtid(200, 201), 2_000_000, 9_500_000, corr=2)            # same correlation id, other process
    trace = load_nsys(ex.close())

    f = [s for s in trace.spans if s.kind == "F"]
    assert len(f) == 1
    assert (f[0].rank, f[0].stage, f[0].mb, f[0].stream) == (0, 3, 7, "compute")
    assert f[0].start == pytest.approx(3000.0) and f[0].duration == pytest.approx(2000.0)
    part = [s for s in trace.spans if s.kind == "F.post_res"]
    assert len(part) == 1 and part[0].stream == "hp"
    assert (part[0].start, part[0].duration) == (pytest.approx(3000.0), pytest.approx(1000.0))
    kernels = [s for s in trace.spans if s.kind == "kernel" and s.rank == 0]
    assert sorted((s.stream, s.start) for s in kernels) == [("cuda:7", 3000.0), ("cuda:7", 6000.0),
                                                           ("cuda:7", 8000.0), ("cuda:9", 4500.0)]
    assert trace.meta["schema_version"] == "3.11.1"
    assert trace.meta["rank_source"] == "pid order"
    assert sorted(trace.ranks) == [0, 1]  # the second process only has a kernel: its own rank


def test_ranges_without_gpu_work_keep_cpu_time_and_foreign_names_are_kept(tmp_path):
    t = gtid(100, 101)
    ex = Export(tmp_path / "b.sqlite", meta_table="EXPORT_META_DATA", version="2.9.1")
    ex.range(t, 1_000, 5_000, "MPI_Send", registered=True)
    ex.range(t, 6_000, 9_000, "SEND_F/s0/mb1~comm")
    ex.range(t, 10_000, 20_000, "W/s0/mb1", event_type=60, end_tid=gtid(100, 105))  # ends on another thread
    ex.launch(t, 11_000, 11_500, corr=1)
    ex.kernel(t, 30_000, 40_000, corr=1)
    trace = load_nsys(ex.close())
    by_name = {s.label: s for s in trace.spans}
    assert by_name["MPI_Send"].kind == "range" and by_name["MPI_Send"].stream == "cpu"
    assert by_name["MPI_Send"].duration == pytest.approx(4.0)
    assert trace.meta["foreign_ranges"] == {"MPI_Send": 1}
    send = [s for s in trace.spans if s.kind == "SEND_F"][0]
    assert send.stream == "cpu" and send.start == pytest.approx(6.0)
    w = [s for s in trace.spans if s.kind == "W"][0]          # start/end range across threads: not projected
    assert w.stream == "cpu" and w.start == pytest.approx(10.0)
    assert trace.meta["unprojected_ranges"] == 3


def test_cpu_only_export_keeps_convention_ranges_on_their_streams(tmp_path):
    t = gtid(7, 8)
    ex = Export(tmp_path / "c.sqlite")
    ex.range(t, 0, 10_000, "F/s0/mb0")
    ex.range(t, 10_000, 12_000, "RECV_B/s1/mb0~comm")
    trace = load_nsys(ex.close(), rank=3)
    assert {(s.kind, s.stream, s.rank) for s in trace.spans} == {("F", "compute", 3), ("RECV_B", "comm", 3)}
    assert trace.meta["projection"].startswith("none")


def test_rank_from_mpi_thread_name_and_newer_table_suffix(tmp_path):
    a, b = gtid(100, 100), gtid(300, 300)
    ex = Export(tmp_path / "d.sqlite", kernel_table="CUPTI_ACTIVITY_KIND_KERNEL_V2")
    ex.thread_name(a, "MPI Rank 5")
    ex.thread_name(b, "MPI Rank 2")
    for tid, corr in ((a, 1), (b, 2)):
        ex.range(tid, 0, 1000, "B/s1/mb0")
        ex.launch(tid, 100, 200, corr)
        ex.kernel(tid, 2000, 3000, corr)
    trace = load_nsys(ex.close())
    assert trace.ranks == [2, 5]
    assert trace.meta["rank_source"] == "thread name"
    assert len([s for s in trace.spans if s.kind == "B"]) == 2


def test_export_without_nvtx_table_loads_kernels_per_stream(tmp_path):
    ex = Export(tmp_path / "e.sqlite", nvtx=False)
    t = gtid(1, 1)
    for i, stream in enumerate((14, 15, 15)):
        ex.launch(t, i, i + 1, corr=i)
        ex.kernel(t, 100 * i, 100 * i + 50, corr=i, stream=stream, name=f"k{i}")
    trace = load_nsys(ex.close())
    assert sorted((s.stream, s.name) for s in trace.spans) == [("cuda:14", "k0"), ("cuda:15", "k1"), ("cuda:15", "k2")]


@pytest.mark.parametrize("version", ["1.0.0", "4.0", "9.9.9"])
def test_unknown_schema_major_version_is_refused(tmp_path, version):
    ex = Export(tmp_path / "v.sqlite", version=version)
    with pytest.raises(TraceError, match=rf"schema version {version} is not supported"):
        load_nsys(ex.close())


def test_missing_metadata_table_is_refused(tmp_path):
    ex = Export(tmp_path / "m.sqlite", meta_table="")
    with pytest.raises(TraceError, match="schema version is unknown"):
        load_nsys(ex.close())


def test_sqlite_that_is_not_an_nsys_export(tmp_path):
    path = tmp_path / "other.sqlite"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE users (id INTEGER, name TEXT)")
    con.commit()
    con.close()
    with pytest.raises(TraceError, match="not an Nsight Systems export"):
        load_nsys(path)


def test_not_sqlite_and_truncated_sqlite(tmp_path):
    text = tmp_path / "x.sqlite"
    text.write_text("hello")
    with pytest.raises(TraceError, match="not a SQLite database"):
        load_nsys(text)
    ex = Export(tmp_path / "full.sqlite")
    t = gtid(1, 1)
    for i in range(2000):
        ex.range(t, i * 10, i * 10 + 5, f"F/s0/mb{i}")
    data = ex.close().read_bytes()
    cut = tmp_path / "cut.sqlite"
    cut.write_bytes(data[: len(data) // 3])
    with pytest.raises(TraceError, match="cut.sqlite"):
        load_nsys(cut)


def test_renamed_column_is_a_clear_error(tmp_path):
    path = tmp_path / "r.sqlite"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE META_DATA_EXPORT (name TEXT, value TEXT)")
    con.execute("INSERT INTO META_DATA_EXPORT VALUES ('EXPORT_SCHEMA_VERSION', '3.1.0')")
    con.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER, end INTEGER, deviceId INTEGER, "
                "streamId INTEGER, correlation INTEGER, globalPid INTEGER)")
    con.commit()
    con.close()
    with pytest.raises(TraceError, match="lacks column.*correlationId"):
        load_nsys(path)
