"""The critical path of a step (traces.analysis.critical_path) on traces whose truth is known.

* schedules.simulate is an as-soon-as-possible schedule of the dependencies: its critical path has no gaps and
  its length is the makespan, for every schedule kind and random per-stage costs (hypothesis).
* The path is a chain of the graph's edges, every op on it has zero slack, and its attribution (per kind, rank,
  stream, phase) adds up to its length.
* Replaying the graph: an op off the path (positive slack) removed leaves the makespan; an op on the path made
  shorter shortens it (random costs: the path is unique).
* A trace with recorded delays between ops (made from a simulated one by ending every op early): length + gaps =
  makespan exactly, and the replay reproduces it.
* A trace whose names do not follow the schedule names the spans that cannot be placed.
"""
from __future__ import annotations

import inspect
import json
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mhcpipe.cli import main
from schedules import Action, Durations, Kind, build, lower_comms, simulate
from traces.analysis.critical_path import critical_path
from traces.analysis.replay import critical_chain, measured_durations, replay, slack
from traces.analysis.span_graph import build_span_graph
from traces.trace import Trace, TraceError

KINDS = [("1f1b", 4, 8), ("gpipe", 3, 5), ("zb1p", 4, 8), ("dualpipe", 4, 8), ("dualpipev", 4, 8)]


def random_durations(schedule, rng: np.random.Generator, latency: float = 0.3) -> Durations:
    per = {s: {"F": float(rng.uniform(0.5, 2)), "I": float(rng.uniform(0.5, 2)), "W": float(rng.uniform(0.2, 1))}
           for s in range(schedule.num_stages)}
    return Durations(per_stage=per, p2p_latency=float(rng.uniform(0, latency)))


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(b))


@settings(max_examples=12, deadline=None)
@given(case=st.sampled_from(KINDS), seed=st.integers(0, 10_000))
def test_on_a_simulated_trace_the_path_length_is_the_makespan(case, seed):
    kind, p, m = case
    s = build(kind, p, m)
    r = simulate(s, random_durations(s, np.random.default_rng(seed)))
    for sched in (None, lower_comms(s)):
        cp = critical_path(r.trace, schedule=sched)
        assert close(cp.makespan_us, r.makespan)
        assert close(cp.length_us, r.makespan), (cp.length_us, r.makespan)
        assert abs(cp.gaps_us) <= 1e-9 * r.makespan
        assert not cp.violations


@pytest.mark.parametrize("kind,p,m", KINDS)
def test_the_path_is_a_chain_with_zero_slack_and_its_parts_add_up(kind, p, m):
    s = build(kind, p, m)
    r = simulate(s, random_durations(s, np.random.default_rng(7)))
    g = build_span_graph(r.trace)
    tm = replay(g)
    ch = critical_chain(tm)
    sl = slack(tm)
    for u, v in zip(ch.nodes, ch.nodes[1:]):
        assert (u, v) in g.edges, (g.nodes[u].label, g.nodes[v].label)
    assert all(sl[v] <= 1e-9 * r.makespan for v in ch.nodes)
    assert (sl >= 0).all() and (sl > 1e-6).any()  # something is off the path
    cp = critical_path(r.trace)
    for part in (cp.by_kind, cp.by_rank, cp.by_stream, cp.by_phase):
        assert close(sum(part.values()), cp.length_us)
    assert close(cp.exposed_comm_us, cp.by_kind.get("P2P", 0.0))
    assert cp.path[0].phase == "fill" and cp.path[-1].phase == "drain"
    assert [p.start_us for p in cp.path] == sorted(p.start_us for p in cp.path)
    assert {(p.rank, p.label) for p in cp.path} <= {k for k, v in cp.slack.items() if v <= 1e-9 * r.makespan}


@pytest.mark.parametrize("kind,p,m", KINDS)
def test_removing_an_op_off_the_path_keeps_the_makespan_shortening_one_on_it_shortens_it(kind, p, m):
    s = build(kind, p, m)
    r = simulate(s, random_durations(s, np.random.default_rng(11)))
    g = build_span_graph(r.trace, schedule=lower_comms(s))
    tm = replay(g)
    on = set(critical_chain(tm).nodes)
    sl = slack(tm)
    rng = np.random.default_rng(3)
    off = [v for v in range(len(g.nodes)) if v not in on and sl[v] > 1e-6 and g.nodes[v].duration > 0]
    for v in rng.choice(off, size=min(5, len(off)), replace=False):
        d = measured_durations(g)
        d[v] = 0.0
        assert close(replay(g, d).makespan, tm.makespan), g.nodes[v].label
    for v in rng.choice(sorted(on), size=5, replace=False):
        if g.nodes[v].duration <= 0:
            continue
        d = measured_durations(g)
        d[v] *= 0.5
        assert replay(g, d).makespan < tm.makespan - 1e-9, g.nodes[v].label


def with_delays(trace: Trace, frac: float = 0.2) -> Trace:
    """Every compute op ends `frac` of its length early; nothing else moves: delays of known size after each op."""
    return Trace([replace(s, duration=s.duration * (1 - frac)) if s.stream == "compute" else s for s in trace.spans],
                 {**trace.meta})


@pytest.mark.parametrize("kind,p,m", KINDS)
def test_with_recorded_delays_length_plus_gaps_is_the_makespan_and_the_replay_reproduces_it(kind, p, m):
    s = build(kind, p, m)
    r = simulate(s, random_durations(s, np.random.default_rng(5)))
    t = with_delays(r.trace)
    cp = critical_path(t)
    assert close(cp.makespan_us, t.makespan())
    assert close(cp.length_us + cp.gaps_us, cp.makespan_us)
    assert cp.gaps_us > 0.05 * cp.makespan_us  # the delays are on the path, not hidden
    assert close(sum(p.gap_before_us for p in cp.path) + cp.gaps_by_rank["step end"], cp.gaps_us)
    g = build_span_graph(t)
    tm = replay(g)
    assert np.allclose(tm.start, [n.start for n in g.nodes], rtol=0, atol=1e-9 * cp.makespan_us)
    assert close(tm.makespan, cp.makespan_us)


def test_names_that_do_not_follow_the_schedule_are_named():
    s = build("1f1b", 4, 6)
    t = simulate(s, Durations(F=1, I=1, W=1, p2p_latency=0.1)).trace
    bad = [replace(x, mb=9) if (x.kind, x.stage, x.mb) == ("F", 1, 3) else x for x in t.spans]
    with pytest.raises(TraceError, match="could not be placed") as err:
        critical_path(Trace(bad, t.meta))
    msg = str(err.value)
    assert "F/s1/mb9 on rank 1 (its input F/s0/mb9 is not in the trace)" in msg
    assert "B/s1/mb3 on rank 1 (its input F/s1/mb3 is not in the trace)" in msg
    assert "RECV_F/s1/mb3~comm on rank 2 (rank 1 never produced F/s1/mb3)" in msg
    with pytest.raises(TraceError, match="no schedule spans"):
        critical_path(Trace([replace(x, kind="range", stage=None, mb=None, name="gemm") for x in t.spans], {}))


def test_critical_path_command_writes_length_makespan_and_the_ordered_path(tmp_path, capsys):
    s = build("dualpipev", 4, 8)
    r = simulate(s, random_durations(s, np.random.default_rng(1)))
    src = r.trace.save(tmp_path / "pred.json")
    assert main(["critical-path", str(src), "--json", str(tmp_path / "cp.json"), "--rows", "6"]) == 0
    out = capsys.readouterr().out
    assert "path length" in out and "exposed communication" in out
    d = json.loads((tmp_path / "cp.json").read_text())
    assert close(d["length_us"], r.makespan) and close(d["makespan_us"], r.makespan)
    starts = [p["start_us"] for p in d["path"]]
    assert starts == sorted(starts) and len(d["path"]) == len(d["path"]) > 6
    assert main(["critical-path", str(tmp_path / "missing.json")]) == 2


def test_compare_reports_both_paths_and_mhc_overhead_along_them_by_cause(tmp_path, capsys):
    """Prediction = the simulated step, measurement = the same step with recorded delays; the "mHC" pair runs every
    forward 2x slower. The causes add up to the overhead; the delays show up as host gaps only on the measured side."""
    s = build("dualpipev", 4, 8)
    d = random_durations(s, np.random.default_rng(12))
    slow = Durations(per_stage={k: {**v, "F": 2 * v["F"]} for k, v in d.per_stage.items()}, p2p_latency=d.p2p_latency)
    files = {}
    for name, dur in (("base", d), ("mhc", slow)):
        pred = simulate(s, dur).trace
        meas = with_delays(pred)
        meas.meta = {**meas.meta, "source": "measured"}
        files[name] = (pred.save(tmp_path / f"{name}_pred.json"), meas.save(tmp_path / f"{name}_meas.json"))
    md = tmp_path / "cmp.md"
    assert main(["compare", str(files["mhc"][0]), str(files["mhc"][1]), "--baseline-pred", str(files["base"][0]),
                 "--baseline-meas", str(files["base"][1]), "--json", str(tmp_path / "c.json"),
                 "--markdown", str(md)]) == 0
    assert "Critical path of a step: predicted vs measured" in capsys.readouterr().out
    assert "mHC overhead along the critical path by cause" in md.read_text()
    cp = json.loads((tmp_path / "c.json").read_text())["critical_path"]
    assert close(cp["pred"]["length_us"], cp["pred"]["makespan_us"]) and cp["meas"]["gaps_us"] > 0
    for side in ("pred", "meas"):
        ov = cp["overhead_on_path"][side]
        assert close(sum(ov["causes_us"].values()), ov["overhead_us"])
        assert ov["causes_us"]["mhc_kernels"] > 0.5 * ov["overhead_us"]
    assert cp["overhead_on_path"]["pred"]["causes_us"]["host_gaps"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.skipif("fb_timing" not in inspect.signature(simulate).parameters,
                    reason="schedules.simulate has no F&B release timing")
@pytest.mark.parametrize("p2p", ["commit", "rendezvous", "dataflow"])
def test_pairs_that_release_their_outputs_mid_pair_keep_length_equal_to_makespan(p2p):
    """F&B pairs whose forward output leaves before the pair ends (the engine's fb_timing, sends posted when
    produced): the path enters the pair at its start and counts the part of it before the release."""
    s = build("dualpipev", 4, 8)
    entered_mid_pair = 0
    for seed in range(8):
        d = random_durations(s, np.random.default_rng(seed))

        def fb_timing(a, lag_f, lag_b, d=d):  # forward half after its input, then the backward half after its own
            f_end = lag_f + d.compute(Action(Kind.F, a.stage, a.mb))
            end = max(f_end, lag_b) + d.compute(Action(Kind.B, a.b_stage, a.b_mb))
            return end, f_end, end

        r = simulate(s, d, p2p=p2p, fb_timing=fb_timing)
        t = Trace(r.trace.spans, {**r.trace.meta, "p2p": p2p})
        cp = critical_path(t)
        assert close(cp.length_us, r.makespan) and not cp.violations
        assert close(sum(cp.by_kind.values()), cp.length_us)
        full = {(x.rank, x.label): x.duration for x in t.spans}
        entered_mid_pair += sum(p.kind == "FB" and p.duration_us < full[(p.rank, p.label)] - 1e-9 for p in cp.path)
    if p2p != "commit":  # committed sends leave at the pair's end: no path enters a pair mid-way
        assert entered_mid_pair > 0
