"""compare(): hand-computed per-op errors, makespan error, idle and waiting for messages per rank, SEND/RECV spans
compared only where they mean the same, the mHC overhead in percentage points, steps, FB pairs and parts;
different schedules are refused; the reports."""
from __future__ import annotations

import json
import math

import pytest

from traces.analysis.compare import compare
from traces.analysis.matching import drop_warmup_step, step_index
from traces.analysis.report import to_json, to_markdown, to_text
from traces.trace import Span, Trace, TraceError
from traces_testlib import one_f_one_b

SCHED = {"kind": "1f1b", "ranks": 2, "microbatches": 1}


def pred_trace() -> Trace:
    return Trace(spans=[
        Span(0, "compute", "F", 0, 0, 0, 10), Span(0, "comm", "SEND_F", 0, 0, 10, 1, peer=1),
        Span(1, "comm", "RECV_F", 0, 0, 10, 1, peer=0), Span(1, "compute", "F", 1, 0, 11, 10),
        Span(1, "compute", "B", 1, 0, 21, 10), Span(0, "compute", "B", 0, 0, 31, 20),
    ], meta={"source": "simulated", "schedule": SCHED})


def meas_trace() -> Trace:
    return Trace(spans=[
        Span(0, "compute", "F", 0, 0, 0, 12.5), Span(0, "comm", "SEND_F", 0, 0, 12.5, 1.5),
        Span(1, "comm", "RECV_F", 0, 0, 12.5, 1.5), Span(1, "compute", "F", 1, 0, 14, 10),
        Span(1, "compute", "B", 1, 0, 24, 8), Span(0, "compute", "B", 0, 0, 34, 20),
    ], meta={"source": "measured"})


def test_hand_computed_errors_makespan_idle_and_waiting_for_messages():
    c = compare(pred_trace(), meas_trace())
    assert c.matched == 6 and c.steps == 1 and c.unmatched_pred == [] and c.unmatched_meas == []
    k = {x.kind: x for x in c.kinds}
    assert [x.kind for x in c.kinds] == ["F", "B"]
    # F: e = (10 - 12.5) / 12.5 = -20 % on rank 0 and 0 % on rank 1
    assert (k["F"].n, k["F"].signed_median_pct, k["F"].median_abs_pct) == (2, pytest.approx(-10), pytest.approx(10))
    assert k["F"].p90_abs_pct == pytest.approx(18)  # linear interpolation between 0 and 20 at 90 %
    # B: e = (10 - 8) / 8 = +25 % on rank 1, 0 % on rank 0
    assert k["B"].signed_median_pct == pytest.approx(12.5) and k["B"].p90_abs_pct == pytest.approx(22.5)
    assert k["B"].pred_mean_us == 15 and k["B"].meas_mean_us == 14
    # the predicted SEND/RECV span is the transfer, the measured one the op from post to completion: side by side
    assert c.comm_span_meaning == {"pred": "transfer", "meas": "post to completion"}
    assert [(x.kind, x.n, x.pred_mean_us, x.meas_mean_us) for x in c.comm_spans] == [("SEND_F", 1, 1, 1.5),
                                                                                   ("RECV_F", 1, 1, 1.5)]
    assert any("listed apart, not compared per op" in n for n in c.notes)
    assert (c.makespan_pred_us, c.makespan_meas_us) == (51, 54)
    assert c.makespan_err_pct == pytest.approx(100 * (51 - 54) / 54)
    r0, r1 = c.ranks
    assert (r0.pred_busy_us, r0.meas_busy_us, r0.pred_idle_us, r0.meas_idle_us) == (30, 32.5, 21, 21.5)
    assert (r1.pred_busy_us, r1.meas_busy_us, r1.pred_idle_us, r1.meas_idle_us) == (20, 18, 31, 36)
    assert r0.pred_bubble_pct == pytest.approx(100 * 21 / 51) and r0.meas_bubble_pct == pytest.approx(100 * 21.5 / 54)
    assert r0.bubble_diff_pp == pytest.approx(100 * (21 / 51 - 21.5 / 54))
    # rank 1 waits from the step's start until its RECV_F completes (pred 11, meas 14); rank 0 receives nothing,
    # its idle time before B is no wait for a message
    assert (r1.pred_recv_wait_us, r1.meas_recv_wait_us) == (11, 14)
    assert (r0.pred_recv_wait_us, r0.meas_recv_wait_us) == (0, 0)


def test_two_predictions_compare_their_transfers_per_op():
    """Both sides are transfers (a prediction against a simulated run): SEND/RECV errors are like with like."""
    other = Trace(spans=meas_trace().spans, meta={"source": "simulated", "schedule": SCHED})
    c = compare(pred_trace(), other)
    assert c.comm_spans == [] and c.comm_span_meaning == {"pred": "transfer", "meas": "transfer"}
    k = {x.kind: x for x in c.kinds}
    assert k["SEND_F"].signed_median_pct == pytest.approx(-100 / 3) and k["RECV_F"].n == 1


def test_measured_waits_are_the_wait_spans_of_receives():
    """A run that records WAIT spans: the wait for a message is its WAIT span, summed per rank over the steps and
    divided by them; a wait for a send (the end-of-step drain) is not a wait for a message."""
    spans = meas_trace().spans + [Span(1, "compute", "WAIT", 0, 0, 1, 13, name="WAIT/RECV_F/s0/mb0"),
                                  Span(0, "compute", "WAIT", 0, 0, 13, 1, name="WAIT/SEND_F/s0/mb0")]
    c = compare(pred_trace(), Trace(spans=spans, meta={"source": "measured", "wait_spans": True}))
    r0, r1 = c.ranks
    assert (r0.meas_recv_wait_us, r1.meas_recv_wait_us) == (0, 13)
    assert r1.meas_comm_wait_us == 13 + 0 and r0.meas_comm_wait_us == 1  # all WAIT time, sends included
    two = one_f_one_b(2, 2, source="measured", steps=2)
    waits = [Span(1, "compute", "WAIT", 0, 0, 0, 3, name="WAIT/RECV_F/s0/mb0"),
             Span(1, "compute", "WAIT", 0, 0, 200, 5, name="WAIT/RECV_F/s0/mb0")]
    c2 = compare(one_f_one_b(2, 2), Trace(spans=two.spans + waits, meta={"source": "measured", "wait_spans": True}))
    assert c2.steps == 2 and c2.ranks[1].meas_recv_wait_us == 4


def test_predicted_wait_stops_at_the_arrival():
    """A rank that idles before a compute action waits for the message only until it arrives: the rest of the
    stretch (executor gap, waiting for a core in the shared-cores simulation) is not communication."""
    spans = [Span(0, "compute", "F", 0, 0, 0, 10), Span(0, "comm", "SEND_F", 0, 0, 10, 1, peer=1),
             Span(1, "comm", "RECV_F", 0, 0, 10, 1, peer=0), Span(1, "compute", "F", 1, 0, 15, 10),
             Span(1, "compute", "B", 1, 0, 25, 10), Span(0, "compute", "B", 0, 0, 36, 20)]
    c = compare(Trace(spans=spans, meta={"source": "simulated", "schedule": SCHED}), meas_trace())
    assert c.ranks[1].pred_recv_wait_us == 11  # from 0 to the arrival at 11, not to F's start at 15
    assert c.ranks[0].pred_recv_wait_us == 0


def test_mhc_overhead_in_percentage_points():
    # 2 ranks, 1 micro-batch, no transfer time: makespan = 2 F + 2 B
    mhc_pred, base_pred = one_f_one_b(2, 1, f=10, b=20, comm=0), one_f_one_b(2, 1, f=9, b=18, comm=0)
    mhc_meas = one_f_one_b(2, 1, f=11, b=21, comm=0, source="measured")
    base_meas = one_f_one_b(2, 1, f=10, b=19, comm=0, source="measured")
    c = compare(mhc_pred, mhc_meas, baseline=(base_pred, base_meas))
    o = c.overhead
    assert (o.mhc_pred_makespan_us, o.base_pred_makespan_us) == (60, 54)
    assert (o.mhc_meas_makespan_us, o.base_meas_makespan_us) == (64, 58)
    assert o.pred_pct == pytest.approx(100 * (60 / 54 - 1)) and o.meas_pct == pytest.approx(100 * (64 / 58 - 1))
    assert o.diff_pp == pytest.approx(100 * (60 / 54 - 64 / 58))
    # added time per kind over (2 ranks x 54 us): F +2, B +4, idle +6 -> the parts add up to the overhead
    assert o.breakdown_pred_pp == pytest.approx({"F": 100 * 2 / 108, "B": 100 * 4 / 108, "idle": 100 * 6 / 108})
    assert sum(o.breakdown_pred_pp.values()) == pytest.approx(o.pred_pct)
    assert sum(o.breakdown_meas_pp.values()) == pytest.approx(o.meas_pct)
    text = to_text(c)
    assert f"{o.diff_pp:+.2f} pp" in text


def test_measured_steps_are_each_compared_and_spread_reported():
    pred = one_f_one_b(3, 4)
    meas = one_f_one_b(3, 4, f=lambda r, m: 10 + r, b=20, source="measured", steps=3, origin=123)
    c = compare(pred, meas)
    assert c.steps == 3 and c.matched == 3 * len(pred.spans)
    assert c.makespan_meas_min_us == c.makespan_meas_max_us == c.makespan_meas_us
    f = next(k for k in c.kinds if k.kind == "F")
    assert f.n == 3 * 12 and f.median_abs_pct == pytest.approx(100 * 1 / 11)  # ranks 0, 1, 2 -> 0, 1/11, 2/12


def test_warmup_step_is_dropped_only_when_another_step_follows():
    pred = one_f_one_b(3, 4)
    meas = one_f_one_b(3, 4, f=lambda r, m: 10 + r, b=20, source="measured", steps=3, origin=123)
    rest = drop_warmup_step(meas)
    assert len(rest.spans) == 2 * len(pred.spans) and sorted(set(step_index(rest).values())) == [0, 1]
    first_end = max(meas.spans[i].end for i, k in step_index(meas).items() if k == 0)
    assert min(s.start for s in rest.spans) >= first_end
    assert compare(pred, rest).steps == 2
    assert drop_warmup_step(pred) is pred  # one step: nothing to drop
    # the warm-up step's other spans on a rank (its waits) go with it; the next step's stay
    second = min(s.start for i, s in enumerate(meas.spans) if s.rank == 1 and step_index(meas)[i] == 1)
    waits = [Span(1, "compute", "WAIT", 0, 0, second - 20, 5, name="WAIT/RECV_F/s0/mb0"),
             Span(1, "compute", "WAIT", 0, 0, second + 1, 5, name="WAIT/RECV_F/s0/mb1")]
    kept = drop_warmup_step(Trace(meas.spans + waits, dict(meas.meta)))
    assert [s.start for s in kept.spans if s.kind == "WAIT"] == [second + 1]


def test_fb_pairs_match_with_partner_and_children_are_not_unmatched():
    pred = Trace(spans=[Span(0, "compute", "FB", 0, 1, 0, 30, partner=(1, 0)), Span(0, "compute", "W", 1, 0, 30, 5),
                        Span(0, "hp", "F.post_res", 0, 1, 2, 1, name="F/s0/mb1/L3.post_res~hp")],
                 meta={"source": "simulated"})
    meas = Trace(spans=[Span(0, "compute", "FB", 0, 1, 0, 33, partner=(1, 0)), Span(0, "compute", "F", 0, 1, 0, 20),
                        Span(0, "compute", "B", 1, 0, 10, 23), Span(0, "compute", "W", 1, 0, 33, 5),
                        Span(0, "hp", "F.post_res", 0, 1, 3, 2, name="F/s0/mb1/L3.post_res~hp"),
                        Span(0, "hp", "F.post_res", 0, 1, 6, 2, name="F/s0/mb1/L4.post_res~hp")],
                 meta={"source": "measured"})
    c = compare(pred, meas)
    kinds = {k.kind: k for k in c.kinds}
    assert kinds["FB"].signed_median_pct == pytest.approx(100 * (30 - 33) / 33)
    assert kinds["F.post_res"].n == 1 and kinds["F.post_res"].signed_median_pct == pytest.approx(-50)
    assert c.unmatched_meas == ["rank 0 F/s0/mb1/L4.post_res"]
    assert any("child ranges of overlapped FB pairs" in n for n in c.notes)
    wrong_partner = Trace(spans=[Span(0, "compute", "FB", 0, 1, 0, 30, partner=(1, 1)),
                                 Span(0, "compute", "W", 1, 0, 30, 5)], meta={"source": "measured"})
    c2 = compare(Trace(spans=pred.spans[:2], meta=pred.meta), wrong_partner)
    assert c2.unmatched_pred == ["rank 0 FB/s0/mb1+s1/mb0"] and c2.unmatched_meas == ["rank 0 FB/s0/mb1+s1/mb1"]


def test_stretches_of_an_overlapped_pair_s_halves_are_its_children_on_the_compute_stream_only():
    """A measured pair's halves recorded as stretches (`F/s0/mb1/L3.block`) on the compute stream are covered by the
    FB span; the same kind of range on the hp stream is not one of them, nor is a stretch of another micro-batch."""
    pred = Trace(spans=[Span(0, "compute", "FB", 0, 1, 0, 30, partner=(1, 0)), Span(0, "compute", "W", 1, 0, 30, 5),
                        Span(0, "hp", "F.post_res", 0, 1, 2, 1, name="F/s0/mb1/L3.post_res~hp")],
                 meta={"source": "simulated"})
    meas = Trace(spans=[Span(0, "compute", "FB", 0, 1, 0, 33, partner=(1, 0)), Span(0, "compute", "W", 1, 0, 33, 5),
                        Span(0, "hp", "F.post_res", 0, 1, 3, 2, name="F/s0/mb1/L3.post_res~hp"),
                        Span(0, "compute", "F.block", 0, 1, 0, 9, name="F/s0/mb1/L3.block"),
                        Span(0, "compute", "B.block", 1, 0, 9, 12, name="B/s1/mb0/L2.block"),
                        Span(0, "hp", "F.block", 0, 1, 21, 4, name="F/s0/mb1/L5.block~hp"),
                        Span(0, "compute", "F.block", 0, 2, 25, 4, name="F/s0/mb2/L3.block")],
                 meta={"source": "measured"})
    more = [Span(0, "compute", "W", 1, mb, 40 + 5 * mb, 5) for mb in range(1, 5)]  # the same schedule: keys shared
    pred, meas = Trace(pred.spans + more, pred.meta), Trace(meas.spans + more, meas.meta)
    c = compare(pred, meas)
    assert c.unmatched_meas == ["rank 0 F/s0/mb1/L5.block", "rank 0 F/s0/mb2/L3.block"]
    assert any(n.startswith("2 measured F/B child ranges") for n in c.notes), c.notes


def test_parts_of_a_prediction_that_prices_whole_actions_are_not_unmatched():
    """A prediction without kernel parts (the `local` runtime profile) against a run that records them: the
    parts are inside their matched actions, said in a note; a prediction with parts still lists a missing one."""
    part = Span(0, "hp", "F.post_res", 0, 0, 3, 2, name="F/s0/mb0/L1.post_res~hp")
    meas = Trace(spans=meas_trace().spans + [part], meta={"source": "measured"})
    c = compare(pred_trace(), meas)
    assert c.unmatched_meas == [] and any("kernel parts (F.post_res)" in n for n in c.notes)
    assert {k.kind for k in c.kinds} == {"F", "B"} and {k.kind for k in c.comm_spans} == {"SEND_F", "RECV_F"}
    to_text(c)  # the report still renders every kind
    with_parts = Trace(spans=pred_trace().spans + [Span(0, "hp", "F.pre", 0, 0, 1, 1, name="F/s0/mb0/L1.pre~hp")],
                       meta=pred_trace().meta)
    c2 = compare(with_parts, meas)
    assert c2.unmatched_meas == ["rank 0 F/s0/mb0/L1.post_res"] and c2.unmatched_pred == ["rank 0 F/s0/mb0/L1.pre"]


def test_different_schedules_are_refused():
    pred = one_f_one_b(2, 4)
    other_kind = one_f_one_b(2, 4, kind="gpipe", source="simulated")
    other_kind.meta["source"] = "measured"
    with pytest.raises(TraceError, match=r"different schedules \(kind '1f1b' vs 'gpipe'\)"):
        compare(pred, other_kind)
    more_ranks = one_f_one_b(4, 4)
    more_ranks.meta["source"] = "measured"
    with pytest.raises(TraceError, match="ranks 2 vs 4"):
        compare(pred, more_ranks)
    # no schedule metadata on the measured side: the (rank, kind, stage, mb) keys differ wholesale
    wholesale = one_f_one_b(3, 6, source="measured")
    with pytest.raises(TraceError,
                       match=r"only 32 of 32 predicted and 84 measured ops share .*only in MEAS: rank 0 B/s0/mb4"):
        compare(pred, wholesale)


def test_swapped_and_unnamed_inputs_are_refused():
    with pytest.raises(TraceError, match="arguments are swapped"):
        compare(meas_trace(), pred_trace())
    kernels_only = Trace(spans=[Span(0, "cuda:7", "kernel", None, None, 0, 5, name="gemm")],
                         meta={"source": "measured", "foreign_ranges": {"## forward ##": 1}})
    with pytest.raises(TraceError, match=r"MEAS has no schedule spans named as in traces.md §5.*## forward ##"):
        compare(pred_trace(), kernels_only)


def test_reports_markdown_and_json():
    c = compare(pred_trace(), meas_trace(), baseline=(pred_trace(), meas_trace()))
    md = to_markdown(c)
    assert "| F | 2 | -10.0 | 10.0 | 18.0 | 10.00 | 11.25 |" in md
    assert "## mHC overhead = T_mHC / T_base - 1" in md and "+0.00 pp" in md
    d = json.loads(json.dumps(to_json(c), allow_nan=False))
    assert d["units"]["overhead_diff"] == "percentage points"
    assert d["overhead"]["diff_pp"] == 0 and d["makespan_pred_us"] == 51
    assert [k["kind"] for k in d["kinds"]] == ["F", "B"]
    assert [k["kind"] for k in d["comm_spans"]] == ["SEND_F", "RECV_F"]
    assert "## Communication spans, not compared per op: predicted = transfer, measured = post to completion" in md
    assert "| SEND_F | 1 | 1.00 | 1.50 |" in md and "recv wait meas" in md
    assert not any(isinstance(v, float) and math.isnan(v) for v in d["kinds"][0].values())


def test_time_budget_carves_mhc_parts_out_of_their_op():
    from traces.analysis.compare import time_stats
    t = Trace(spans=[Span(0, "compute", "F", 0, 0, 0, 10), Span(0, "compute", "F.pre", 0, 0, 2, 2,
                                                                  name="F/s0/mb0/L0.pre"),
                     Span(0, "hp", "F.post_res", 0, 0, 8, 3, name="F/s0/mb0/L0.post_res~hp"),  # other stream
                     Span(0, "compute", "B", 0, 0, 12, 10)], meta={"source": "simulated"})
    st = time_stats(t)
    assert st.rank_kind_time[0] == {"F": 8, "F.pre": 2, "F.post_res": 3, "B": 10}  # post_res outlasts F
    assert st.busy[0] == 21 and st.idle[0] == 1  # hp extends compute by 1 us: [0, 11] and [12, 22]


def test_units_that_differ_are_noted():
    pred = pred_trace()
    pred.meta["time_unit"] = "cost units"
    assert any("time units differ" in n for n in compare(pred, meas_trace()).notes)


def test_simulated_dualpipev_from_schedules_round_trips_and_matches_itself():
    """Integration with the schedule simulator: its FB spans (with partner) and P2P spans survive Chrome export,
    and a measurement equal to the prediction (shifted clock, one op 10 % slower) matches 1:1."""
    from dataclasses import replace

    from schedules import Durations, build, simulate
    from traces.formats.chrome import chrome_to_traces, to_chrome, validate_chrome

    pred = simulate(build("dualpipev", 4, 8), Durations(F=10, I=10, W=8, p2p_latency=0.5)).trace
    assert any(s.kind == "FB" and s.partner is not None for s in pred.spans)
    data = to_chrome(pred)
    assert validate_chrome(data) == []
    assert chrome_to_traces(data)[0].spans == pred.spans
    slow = next(i for i, s in enumerate(pred.spans) if s.kind == "FB")
    meas_spans = [replace(s, start=s.start + 5000) for s in pred.spans]
    meas_spans[slow] = replace(meas_spans[slow], duration=pred.spans[slow].duration * 1.1)
    c = compare(pred, Trace(spans=meas_spans, meta={"source": "measured"}))
    assert c.matched == len(pred.spans) and not c.unmatched_pred and not c.unmatched_meas
    fb = next(k for k in c.kinds if k.kind == "FB")
    assert fb.pred_mean_us == 28 and fb.meas_mean_us == pytest.approx(28 + 2.8 / fb.n)  # F + I + W, one 10 % slower
    assert all(k.median_abs_pct == 0 for k in c.kinds) and c.makespan_err_pct <= 0


def test_compare_plot_without_a_baseline_fails_before_any_output(tmp_path, capsys):
    from mhcpipe.cli import main

    assert main(["compare", str(tmp_path / "p.json"), str(tmp_path / "m.json"), "--plot", str(tmp_path / "o.png")]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and len(cap.err.strip().splitlines()) == 1 and "--plot draws mHC's overhead" in cap.err


def test_matched_pairs_lone_prediction_with_every_step_and_steps_with_steps():
    """The matched pairs (matching.matched_indices, under compare and match_spans): a lone predicted instance pairs
    with every measured instance of its key, k instances with k, the shorter side deciding; keys on one side only
    pair with nothing; in the predicted keys' order."""
    from traces.analysis.matching import key_groups, match_spans, matched_indices

    pred, meas = pred_trace(), meas_trace()
    two = Trace(spans=meas.spans + [Span(s.rank, s.stream, s.kind, s.stage, s.mb, s.start + 100, s.duration,
                                         peer=s.peer) for s in meas.spans], meta=meas.meta)
    extra = Trace(spans=pred.spans + [Span(0, "compute", "W", 0, 0, 60, 1)], meta=pred.meta)
    for p, m in ((pred, two), (two, two), (extra, meas), (two, meas)):
        pg, mg = key_groups(p), key_groups(m)
        want = []
        for key, pidx in pg.items():
            midx = mg.get(key, [])
            want += [(pidx[0], i) for i in midx] if len(pidx) == 1 else list(zip(pidx, midx))
        pp, mm = matched_indices(p, m)
        assert list(zip(pp.tolist(), mm.tolist())) == want == match_spans(p, m)
        assert want


def test_kind_times_are_the_same_floats_whatever_the_hash_seed():
    """compare's per-kind times sum the ranks' medians in one order: a set's order follows str hashes, which Python
    seeds per process, and the sums then differed in their last bits from run to run."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("from traces.formats.io import load_trace; from traces.analysis.compare import time_stats; "
            "import sys; print(repr(time_stats(load_trace(sys.argv[1])).kind_time))")
    trace = Path(__file__).parent / "data" / "predicted_dualpipev_tiny.json.gz"
    root = Path(__file__).resolve().parents[2]
    outs = {subprocess.run([sys.executable, "-c", code, str(trace)], capture_output=True, text=True, check=True,
                           cwd=root, env={**os.environ, "PYTHONHASHSEED": str(seed), "PYTHONPATH": str(root)}).stdout
            for seed in range(6)}
    assert len(outs) == 1, outs
