"""costmodel.fitting.measured_pair on hand-made traces: serial pairs cut into chains, predictions, measured pairs."""
from __future__ import annotations

import pytest

from costmodel.fitting.measured_pair import (chains, cores_taken_pct, hidden_pct, measure_pairs, predict,
                                             serial_samples, steady)
from traces.analysis.comm_overlap import comm_overlap, total
from traces.trace import Span, Trace

META = {"wait_spans": True, "p2p_completion": "stamped"}


def a2a(rank, stage, mb, layer, op, part, start, dur):
    kind = op if part is None else f"{op}.{part}"
    name = f"{op}/s{stage}/mb{mb}/L{layer}" + (f".{part}" if part else "")
    return Span(rank, "comm", kind, stage, mb, start, dur, name=f"{name}~comm")


def wait(rank, stage, mb, target, start, dur):
    return Span(rank, "compute", "WAIT", stage, mb, start, dur, name=f"WAIT/{target}")


def serial_pair(rank, t0, f, b, f_chunk=(0, 1), b_chunk=(3, 0)):
    """A serial F&B pair starting at t0. f, b: ("c", us) compute, ("hp", us) an inline post_res (compute that ends
    a block), ("a", op, layer, part, us) an all-to-all waited right after its post."""
    spans, t = [], t0
    for side, parts, (st, mb) in (("F", f, f_chunk), ("B", b, b_chunk)):
        begin = t
        for p in parts:
            if p[0] == "c":
                t += p[1]
            elif p[0] == "hp":
                spans.append(Span(rank, "hp", "F.post_res", st, mb, t, p[1],
                                  name=f"{side}/s{st}/mb{mb}/L3.post_res~hp"))
                t += p[1]
            else:
                _, op, layer, part, us = p
                s = a2a(rank, st, mb, layer, op, part, t, us)
                spans += [s, wait(rank, st, mb, s.label[:-5], t, us)]
                t += us
        spans.append(Span(rank, "compute", side, st, mb, begin, t - begin, name=f"{side}/s{st}/mb{mb}"))
    spans.append(Span(rank, "compute", "FB", f_chunk[0], f_chunk[1], t0, t - t0, partner=b_chunk))
    return spans, t


F_PARTS = [("c", 10.0), ("a", "A2A_DISPATCH", 3, "counts", 4.0), ("c", 6.0), ("a", "A2A_DISPATCH", 3, None, 20.0),
           ("c", 8.0), ("a", "A2A_COMBINE", 3, None, 15.0), ("c", 3.0), ("hp", 2.0), ("c", 7.0)]
B_PARTS = [("c", 12.0), ("a", "A2A_COMBINE", 3, "dgrad", 18.0), ("c", 9.0), ("a", "A2A_DISPATCH", 3, "dgrad", 11.0),
           ("c", 5.0)]


def test_serial_prediction_reproduces_each_measured_pair():
    spans, t = serial_pair(0, 100.0, F_PARTS, B_PARTS)
    f2 = [("c", 1.5 * p[1]) if p[0] == "c" else p for p in F_PARTS]
    spans2, _ = serial_pair(1, t + 50.0, f2, B_PARTS)
    for sample, parts in zip(serial_samples(Trace(spans + spans2, META)), (F_PARTS, f2)):
        (halves, used), = chains([sample]).values()
        assert used == 1
        assert predict(halves).serial_us == pytest.approx(sample.duration, rel=1e-12)
        # the forward is cut at its three all-to-alls and at the block's end (the inline post_res)
        f, b = halves
        assert [op.stream for op in f].count("comm") == 3 and [op.stream for op in b].count("comm") == 2
        assert [op.name for op in f if op.switch] == ["F.c6"]
        assert sum(op.duration for op in f) == pytest.approx(sum(p[-1] for p in parts))


def test_chains_are_medians_per_op_over_pairs_of_a_kind():
    spans, t = [], 0.0
    for scale in (1.0, 5.0, 2.0):
        s, t = serial_pair(0, t + 10.0, [(p[0], scale * p[1]) if p[0] == "c" else p for p in F_PARTS], B_PARTS)
        spans += s
    samples = serial_samples(Trace(spans, META))
    (halves, used), = chains(samples).values()
    assert used == 3
    # the chains sum to the median pair (here the op medians already do)
    assert predict(halves).serial_us == pytest.approx(sorted(s.duration for s in samples)[1], rel=1e-12)
    assert halves[0][0].duration == pytest.approx(2.0 * 10.0)  # the median scale
    assert halves[1][0].duration == pytest.approx(12.0)


def test_chains_scale_op_medians_to_the_median_pair():
    """Skewed op times: the op medians sum to less than the median pair; the chains are scaled up to it, the
    ops keeping their median shares."""
    spans, t = [], 0.0
    for c0, c1 in ((10.0, 10.0), (30.0, 10.0), (10.0, 30.0)):
        s, t = serial_pair(0, t + 10.0, [("c", c0), ("a", "A2A_DISPATCH", 3, None, 20.0), ("c", c1)], [("c", 5.0)])
        spans += s
    (halves, _), = chains(serial_samples(Trace(spans, META))).values()
    assert predict(halves).serial_us == pytest.approx(65.0)  # pairs of 45, 65, 65; op medians sum to 45
    f = halves[0]
    assert f[0].duration == pytest.approx(f[2].duration)
    assert f[1].duration / f[0].duration == pytest.approx(2.0)


@pytest.mark.parametrize("mode", ["streams", "turns"])
@pytest.mark.parametrize("b_compute", [0.0, 5.0, 20.0, 60.0])
def test_overlap_hides_comm_only_under_the_other_halfs_compute(b_compute, mode):
    """F: compute, an all-to-all of 20, compute; B: compute only. The all-to-all can hide only under B's
    compute, so hidden time = min(B compute, 20), and the pair never takes longer than serially."""
    f = [("c", 10.0), ("a", "A2A_DISPATCH", 3, None, 20.0), ("c", 10.0)]
    spans, _ = serial_pair(0, 0.0, f, [("c", b_compute)])
    (halves, _), = chains(serial_samples(Trace(spans, META))).values()
    p = predict(halves, mode)
    assert p.hidden_pct * 20.0 / 100.0 == pytest.approx(min(b_compute, 20.0), abs=1e-9)
    assert p.overlap_us <= p.serial_us * (1 + 1e-12)
    assert p.overlap_us == pytest.approx(p.serial_us - min(b_compute, 20.0))


def test_turns_hand_the_thread_to_the_half_that_can_compute():
    """The CPU runtime's policy: F parks on a slow all-to-all (50), B's short one (5) completes first and B
    computes on; F resumes when B is done. F 0-10, post (until 60); B 10-20, post (until 25); both parked:
    blocked 20-25 (exposed 5); B 25-85; F 85-95."""
    f = [("c", 10.0), ("a", "A2A_DISPATCH", 3, None, 50.0), ("c", 10.0)]
    b = [("c", 10.0), ("a", "A2A_COMBINE", 3, "dgrad", 5.0), ("c", 60.0)]
    spans, _ = serial_pair(0, 0.0, f, b)
    (halves, _), = chains(serial_samples(Trace(spans, META))).values()
    p = predict(halves, "turns")
    assert p.overlap_us == pytest.approx(95.0)
    assert p.hidden_pct == pytest.approx(100.0 * 50.0 / 55.0)
    assert p.serial_us == pytest.approx(145.0)
    with pytest.raises(ValueError, match="streams or turns"):
        predict(halves, "cuda")


def test_turns_switch_at_block_boundaries():
    """A block boundary hands the thread over too: F 0-5 (block end), B 5-35, F 35-40, post (until 60),
    blocked 40-60, F 60-70. Without that switch F would post at 10 and end at 50."""
    f = [("c", 3.0), ("hp", 2.0), ("c", 5.0), ("a", "A2A_DISPATCH", 3, None, 20.0), ("c", 10.0)]
    spans, _ = serial_pair(0, 0.0, f, [("c", 30.0)])
    (halves, _), = chains(serial_samples(Trace(spans, META))).values()
    p = predict(halves, "turns")
    assert p.overlap_us == pytest.approx(70.0)
    assert p.hidden_pct == pytest.approx(0.0, abs=1e-9)


def test_measured_hidden_matches_traces_comm_overlap():
    """Overlapped pairs: per-kind all-to-all hidden % sums to traces.analysis.comm_overlap's F&B number."""
    spans = [Span(0, "compute", "step", None, None, 0.0, 1.0, name="step/0"),
             Span(0, "compute", "step", None, None, 5.0, 500.0, name="step/1")]
    for k, (t0, kind) in enumerate(((10.0, ((0, 1), (3, 0))), (200.0, ((1, 2), (2, 1))))):
        (fs, fm), (bs, bm) = kind
        spans.append(Span(0, "compute", "FB", fs, fm, t0, 100.0, partner=(bs, bm)))
        x = a2a(0, fs, fm, 3, "A2A_DISPATCH", None, t0 + 10, 40.0)
        y = a2a(0, bs, bm, 3, "A2A_COMBINE", "dgrad", t0 + 20, 30.0)
        spans += [x, y, wait(0, fs, fm, x.label[:-5], t0 + 40, 10.0 * (k + 1)),
                  wait(0, bs, bm, y.label[:-5], t0 + 45, 5.0 if k == 0 else 35.0),  # longer than the op
                  wait(0, fs, fm, f"RECV_F/s{fs}/mb{fm}", t0, 3.0)]
    trace = steady(Trace(spans, META), 1)
    got = measure_pairs(trace)
    assert set(got) == {(0, 3), (1, 2)}
    assert got[(0, 3)].hidden_pct == pytest.approx(100 * (1 - 15 / 70))
    assert got[(0, 3)].input_wait_us == [3.0]
    ref = total(comm_overlap(Trace([s for s in trace.spans if not (s.stream == "comm" and "A2A" not in s.kind)],
                                   META)), fb=True)
    assert hidden_pct(got) == pytest.approx(ref.hidden_pct, rel=1e-12)


def test_bad_inputs_are_one_line_errors():
    spans, _ = serial_pair(0, 0.0, F_PARTS, B_PARTS)
    no_b = [s for s in spans if s.kind != "B"]
    with pytest.raises(ValueError, match="--no-overlap"):
        serial_samples(Trace(no_b, META))
    with pytest.raises(ValueError, match="warmup=4"):
        steady(Trace(spans, META), 4)


def test_cores_taken_counts_pair_a2a_waits_while_enough_other_ranks_are_busy():
    """Rank 0 waits 20 us on an all-to-all inside its pair, [10, 30). Other ranks busy (in a step, not in a WAIT):
    rank 2 always, rank 1 from 20 on, rank 3 until 15. So >= 2 others busy on [10, 15) and [20, 30): 15 of 20 us.
    Waits outside a pair and waits for a receive do not count."""
    spans = [Span(r, "compute", "step", None, None, 0.0, 100.0, name="step/0") for r in range(4)]
    spans += [Span(0, "compute", "FB", 0, 1, 0.0, 50.0, partner=(3, 0), name="FB/s0/mb1+s3/mb0"),
              wait(0, 0, 1, "A2A_DISPATCH/s0/mb1/L3", 10.0, 20.0),
              wait(0, 0, 1, "RECV_F/s0/mb1", 40.0, 5.0),  # a receive: not an all-to-all
              wait(0, 0, 2, "A2A_DISPATCH/s0/mb2/L3", 60.0, 10.0),  # outside the pair
              wait(1, 1, 0, "RECV_F/s1/mb0", 0.0, 20.0), wait(3, 1, 0, "RECV_F/s1/mb0", 15.0, 85.0)]
    trace = Trace(spans, dict(META))
    assert cores_taken_pct(trace, 2) == pytest.approx(75.0, abs=1e-9)
    assert cores_taken_pct(trace, 1) == pytest.approx(100.0, abs=1e-9)
    assert cores_taken_pct(trace, 3) == pytest.approx(0.0, abs=1e-9)
    assert cores_taken_pct(Trace([s for s in spans if s.kind != "step"], dict(META)), 2) is None
    with pytest.raises(ValueError, match="cores=0"):
        cores_taken_pct(trace, 0)
