"""bench/trace_scale_ranks.py's synthetic many-rank step, and the critical path on it checked by brute force.

The brute force is independent of the trace analysis: every path through the schedule's own dependency graph
(schedules.graph, the simulator's rules as explicit edges), each action weighted by the duration the trace
recorded for it on the slowest replica (a transfer: its RECV span), enumerated one by one. The longest is the
step; the critical path `mhcpipe critical-path` reports must be as long and run through the compute ops of one of
the longest paths, in order.
"""
from __future__ import annotations

import pytest

from _bench_helpers import load_bench
from schedules import build, lower_comms
from schedules.graph import dependency_graph
from schedules.ir import COMM_KINDS, Kind, to_name
from traces.analysis.critical_path import critical_path
from traces.analysis.replicas import one_replica

bench = load_bench("trace_scale_ranks")


def _all_paths(g, weight):
    """(length, compute labels) of every source-to-sink path, by enumeration (no dynamic programming)."""
    sources = [v for v in g if g.in_degree(v) == 0]
    out = []
    stack = [(v, weight(v), (v,)) for v in sources]
    while stack:
        v, length, path = stack.pop()
        succ = list(g.successors(v))
        if not succ:
            out.append((length, path))
        for w in succ:
            stack.append((w, length + weight(w), path + (w,)))
    return out


@pytest.mark.parametrize("kind, pp, dp, m", [("1f1b", 3, 2, 5), ("dualpipev", 2, 3, 4), ("zb1p", 3, 1, 4)])
def test_the_critical_path_is_a_longest_path_of_the_schedule(kind, pp, dp, m):
    trace = bench.synthetic_step(pp, dp, m, layers=2, schedule=kind)
    cp = critical_path(trace)
    replica = one_replica(trace)
    assert replica.meta.get("replica", 0) == dp - 1  # the slowest replica is the one analysed
    compute = {}  # (rank, action name) -> the recorded duration; transfers: (receiver, RECV name)
    for s in replica.spans:
        if s.stream == "compute" and s.kind in ("F", "I", "W", "B", "FB"):
            compute[(s.rank, s.label)] = s.duration
        elif s.kind in ("RECV_F", "RECV_B"):
            compute[(s.rank, f"{s.kind}/s{s.stage}/mb{s.mb}")] = s.duration
    sched = lower_comms(build(kind, pp, m))
    g = dependency_graph(sched)

    def name(v):
        a = sched.actions[v[0]][v[1]]
        if a.kind in (Kind.RECV_F, Kind.RECV_B):
            return f"{a.kind.value}/s{a.stage}/mb{a.mb}"
        return None if a.kind in COMM_KINDS else to_name(a)

    def weight(v):
        n = name(v)
        return 0.0 if n is None else compute[(v[0], n)]

    paths = _all_paths(g, weight)
    assert 10 < len(paths) < 2_000_000
    best = max(length for length, _ in paths)
    assert cp.length_us == pytest.approx(best, rel=1e-12)
    assert cp.makespan_us == pytest.approx(best, rel=1e-12)
    longest = {tuple(name(v) for v in p if name(v) and not name(v).startswith("RECV"))
               for length, p in paths if length >= best * (1 - 1e-12)}
    ours = tuple(step.label for step in cp.path if step.kind != "P2P")
    assert ours in longest


def test_the_bench_step_has_the_ops_a_step_records():
    trace = bench.synthetic_step(4, 2, 8, layers=2)
    assert sorted(trace.ranks) == list(range(8))
    kinds = {s.kind for s in trace.spans}
    assert {"F", "B", "FB", "SEND_F", "RECV_B", "A2A_DISPATCH", "A2A_COMBINE.dgrad", "F.post_res", "RG",
            "OPT"} <= kinds
    per_rank = len(trace.spans) / 8
    assert 150 < per_rank < 400  # ~20 ops per micro-batch and stage at 2 layers


def test_a_picture_of_many_ranks_draws_one_pipeline_in_full_and_the_other_replicas_summarised(tmp_path, capsys):
    from mhcpipe.cli import main
    from traces.drawing.replica_summary import OTHERS, summarise_replicas

    trace = bench.synthetic_step(4, 12, 8, layers=1)  # 48 ranks
    small = bench.synthetic_step(4, 2, 8, layers=1)
    assert summarise_replicas(small) is small  # 8 ranks: drawn rank by rank as before
    summary = summarise_replicas(trace)
    full = one_replica(trace)
    assert summary.meta["replica"] == 11 and sorted(summary.ranks) == [0, 1, 2, 3]
    assert [s for s in summary.spans if s.stream != OTHERS] == full.spans
    rows = {(s.rank, s.stream) for s in summary.spans}
    assert {(p, OTHERS) for p in range(4)} <= rows
    # an op on the other replicas: from its first start to its last end on any of them (replica d: rank p*12+d)
    op = next(s for s in trace.spans if s.rank == 1 * 12 + 0 and s.kind == "F" and s.stream == "compute")
    same = [s for s in trace.spans if s.rank // 12 == 1 and s.rank % 12 != 11 and s.stream == "compute"
            and (s.kind, s.stage, s.mb) == (op.kind, op.stage, op.mb)]
    row = next(s for s in summary.spans if s.stream == OTHERS and s.rank == 1 and s.name.startswith(op.label + " "))
    assert (row.start, row.end) == (min(s.start for s in same), max(s.end for s in same)) and len(same) == 11
    # the summary rows are not schedule spans: the step and its critical path are the full pipeline's
    a, b = critical_path(summary), critical_path(full)
    assert (a.makespan_us, a.by_kind) == (b.makespan_us, b.by_kind)
    assert [p.label for p in a.path] == [p.label for p in b.path]
    path = trace.save(tmp_path / "t.json")
    assert main(["view", str(path), "-o", str(tmp_path / "t.png")]) == 0
    out = capsys.readouterr().out
    assert "4 rank rows, critical path of 1 trace(s) outlined" in out and "replica 11 (the slowest) in full" in out


def test_the_critical_path_of_a_data_parallel_run_is_outlined_on_its_global_ranks():
    """The path's spans are the slowest replica's copies renumbered to pipeline ranks: the picture (and Perfetto's
    path threads) must find them on their global ranks, not draw nothing (as before) or on the wrong processes."""
    from traces.drawing.path_marks import chrome_path_events, paths_for, place
    from traces.drawing.view import build_layout
    from traces.formats.chrome import PREDICTED_PID_OFFSET

    trace = bench.synthetic_step(2, 3, 4, layers=1)  # 6 ranks: drawn rank by rank
    lay = build_layout([trace], ["t"])
    paths, _ = paths_for([trace])
    marks = place(paths, lay.cell_of, lay.origins, [trace])
    assert len(marks) == len(paths[0].path) > 10
    assert {lay.rows[m.row].rank % 3 for m in marks} == {2}  # global ranks of the slowest replica (d = 2)
    pids = {e["pid"] for e in chrome_path_events([trace], paths) if e.get("cat") == "critical_path"}
    assert pids and all((pid - PREDICTED_PID_OFFSET) % 3 == 2 for pid in pids)  # a simulated trace's pids
