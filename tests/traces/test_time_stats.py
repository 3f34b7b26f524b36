"""traces/analysis/time_stats.py on columns gives the floats of the one-step-at-a-time rule it replaced
(tests/traces/time_stats_reference.py), on the suite's traces, on simulated steps of every schedule and on random
multi-step traces built to hit the rules' corners: ties of start and length, parts nested in their op or sticking out
of it, parts on the hp stream, stretches of an F&B pair's halves, receives arriving inside idle stretches, spans a
reader put on a "cpu" stream, an incomplete last step, WAIT spans."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from time_stats_reference import reference_time_stats
import traces.analysis.time_stats as time_stats_module
from traces.analysis.time_stats import time_stats
from traces.formats.io import load_trace
from traces.trace import Span, Trace

DATA = Path(__file__).parent / "data"


def _same(trace: Trace) -> None:
    got = time_stats(trace)
    want = reference_time_stats(Trace(spans=trace.spans, meta=trace.meta))  # nothing kept shared between the two
    assert repr(got) == repr(want)  # repr: the same floats to the last bit, the same dict orders


@pytest.mark.parametrize("name", ["measured_dualpipev_tiny", "predicted_dualpipev_tiny", "measured_emulated_pp2_dp2"])
def test_the_suite_traces(name):
    _same(load_trace(DATA / f"{name}.json.gz"))


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb1p", "dualpipe", "dualpipev"])
def test_simulated_steps_of_every_schedule(kind):
    from schedules import Durations, build, simulate

    sim = simulate(build(kind, 4, 8), Durations(F=10, I=9, W=7, p2p_latency=0.5)).trace
    span = max(s.end for s in sim.spans) + 3.0
    # three steps, the second a little slower: the medians pick a step, not an average
    spans = [Span(s.rank, s.stream, s.kind, s.stage, s.mb, s.start + k * span, s.duration * (1.1 if k == 1 else 1.0),
                  s.partner, s.peer) for k in range(3) for s in sim.spans]
    _same(Trace(spans=spans, meta=dict(sim.meta)))


def _random_trace(seed: int) -> Trace:
    """One step's spans drawn at random, then repeated with its times scaled per step by a power-of-two multiple
    (exact: the order and the ties stay, the medians pick a step). A run lists its steps alike: each rank's ops in
    program order, the rule before time_stats (the reference) needs a lane's top-level spans in start order in
    every step."""
    rnd = random.Random(seed)
    ranks = rnd.randint(1, 4)
    steps = rnd.randint(1, 4)
    step = _random_step(rnd, ranks)
    length = max(s.end for s in step) + 1.0
    spans: list[Span] = []
    t = 0.0
    for k in range(steps):
        f = rnd.choice((1.0, 1.25, 0.75, 1.5))
        last = k == steps - 1 and steps > 1 and rnd.random() < 0.5  # an incomplete last step now and then
        spans += [Span(s.rank, s.stream, s.kind, s.stage, s.mb, t + s.start * f, s.duration * f, s.partner, s.peer,
                       s.name) for s in step if not (last and rnd.random() < 0.7)]
        t += length * f
    meta = {"source": rnd.choice(("measured", "predicted"))}
    if rnd.random() < 0.3:
        meta["wait_spans"] = True
        spans += [Span(0, "compute", "WAIT", 0, 0, 1.0, 0.5, name="WAIT/RECV_F/s0/mb0"),
                  Span(0, "compute", "WAIT", 0, 1, 3.0, 0.25, name="WAIT/RECV_B/s0/mb1")]
    return Trace(spans=spans, meta=meta)


def _random_step(rnd: random.Random, ranks: int) -> list[Span]:
    grid = (0.5, 1.0, 1.5, 2.0, 3.0)  # few lengths and starts on a grid: ties of start and of length
    ops = [(r, k, st, mb) for r in range(ranks) for k, st, mb in
           (("F", r, 0), ("F", r, 1), ("B", r, 0), ("W", r, 0), ("FB", r, 2), ("I", r, 1))]
    listed: list[Span] = []
    t = 0.0
    for r in range(ranks):
        now = t + rnd.choice(grid)
        for (rr, kind, st, mb) in ops:
            if rr != r:
                continue
            d = rnd.choice(grid) * 2
            stream = rnd.choice(("compute", "compute", "cpu"))
            partner = (st + 1, mb) if kind == "FB" else None
            name = f"FB/s{st}/mb{mb}+s{st + 1}/mb{mb}" if kind == "FB" else f"{kind}/s{st}/mb{mb}"
            listed.append(Span(r, stream, kind, st, mb, now, d, partner, name=name if stream == "cpu" else ""))
            for j, part in enumerate(("pre", "post_res")):
                if rnd.random() < 0.6:
                    half = "F" if kind == "FB" and j == 0 else "B" if kind == "FB" else kind
                    ps = now + rnd.choice((0.0, 0.5, 1.0)) * d / 2
                    pd = rnd.choice((0.5, 1.0, d))  # sometimes as long as the op, or past its end
                    hp = rnd.random() < 0.3
                    pname = f"{half}/s{st}/mb{mb}/L{j}.{part}" + ("~hp" if hp else "")
                    listed.append(Span(r, "hp" if hp else stream if stream == "cpu" else "compute",
                                       f"{half}.{part}", st, mb, ps, pd, name=pname))
            if rnd.random() < 0.5:  # a receive arriving in the idle stretch before the next op
                listed.append(Span(r, "comm", "RECV_F", st, mb, now + d - 0.5, rnd.choice(grid),
                                   peer=(r + 1) % ranks))
            if rnd.random() < 0.3:
                listed.append(Span(r, "comm", "SEND_B", st, mb, now, rnd.choice(grid), peer=(r + 1) % ranks))
            now += d + rnd.choice((0.0, 0.0, 0.5, 2.0))
    listed.sort(key=lambda s: s.start)  # as a run lists them: by start
    return listed


@pytest.mark.parametrize("seed", range(40))
def test_random_traces(seed):
    _same(_random_trace(seed))


@pytest.mark.parametrize("block_rows", [1, 97])
@pytest.mark.parametrize("seed", range(0, 40, 5))
def test_blocks_of_steps_give_the_whole_s_floats(monkeypatch, seed, block_rows):
    """time_stats works on blocks of whole steps (bounded temporaries at 10^7 spans): a step per block, or a few,
    gives the floats of the rule over every step at once; the suite's measured run too."""
    monkeypatch.setattr(time_stats_module, "BLOCK_ROWS", block_rows)
    _same(_random_trace(seed))
    _same(load_trace(DATA / "measured_dualpipev_tiny.json.gz"))


def test_a_part_listed_before_its_op_is_carved_out_of_it():
    """A lane's top-level spans are looked up by start: a run that lists an op after a later op (threads finishing
    out of order) still has the part carved out of the op that holds it."""
    spans = [Span(0, "compute", "B", 0, 0, 20, 10), Span(0, "compute", "F", 0, 0, 0, 10),
             Span(0, "compute", "F.pre", 0, 0, 2, 3, name="F/s0/mb0/L0.pre")]
    st = time_stats(Trace(spans=spans, meta={"source": "measured"}))
    assert st.rank_kind_time[0] == {"B": 10, "F": 7, "F.pre": 3}


def test_a_receive_arriving_at_the_tolerance_edge_counts():
    """The timeline's waits count a receive that completes up to 1e-9 relative after the op starts (a clock's
    rounding): one arriving exactly there counts, its wait ending at the op's start."""
    start = 10.0
    edge = start + 1e-9 * max(1.0, abs(start))
    spans = [Span(0, "compute", "F", 0, 0, 0.0, 2.0), Span(0, "comm", "RECV_F", 0, 1, edge, 0.0, peer=1),
             Span(0, "compute", "F", 0, 1, start, 2.0)]
    trace = Trace(spans=spans, meta={"source": "measured"})
    assert time_stats(trace).recv_wait == {0: 8.0}
    _same(trace)
