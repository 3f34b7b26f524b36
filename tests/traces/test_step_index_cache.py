"""The step index kept on a trace (traces.analysis.matching.step_index) is the one a fresh pass computes: after
drop_warmup_step (which derives it from the dropped trace's) and after the span list changes."""
from __future__ import annotations

import random

from schedules import build, simulate
from traces.analysis.matching import drop_warmup_step, key_groups, step_index
from traces.trace import Span, Trace


def _fresh(trace: Trace) -> dict[int, int]:
    out = {}
    for idx in key_groups(trace).values():
        for k, i in enumerate(idx):
            out[i] = k
    return out


def _steps(n: int) -> Trace:
    """`n` steps of a simulated DualPipeV run back to back, with a WAIT span per rank and step, shuffled."""
    one = simulate(build("dualpipev", 2, 4)).trace
    length = max(s.end for s in one.spans) * 1.1
    spans = []
    for k in range(n):
        spans += [Span(s.rank, s.stream, s.kind, s.stage, s.mb, s.start + k * length, s.duration, s.partner, s.peer)
                  for s in one.spans]
        spans += [Span(r, "compute", "WAIT", None, None, k * length + 0.5, 0.1) for r in range(2)]
    random.Random(3).shuffle(spans)
    return Trace(spans=spans, meta=dict(one.meta))


def test_the_kept_index_after_dropping_the_warmup_is_a_fresh_one():
    trace = _steps(4)
    assert step_index(trace) == _fresh(trace) and max(_fresh(trace).values()) == 3
    dropped = drop_warmup_step(trace)
    assert len(dropped.spans) < len(trace.spans)
    assert step_index(dropped) == _fresh(dropped) and max(_fresh(dropped).values()) == 2


def test_a_changed_span_list_is_indexed_again():
    trace = _steps(3)
    step_index(trace)
    trace.spans = trace.spans[: len(trace.spans) // 2]
    assert step_index(trace) == _fresh(trace)
    trace.spans.append(trace.spans[0])
    assert step_index(trace) == _fresh(trace)


def test_dropping_the_warmup_takes_its_spans_and_keeps_the_rest():
    """The first step's schedule spans go, and on each rank the other spans that start before its first schedule
    span of the next step; a rank without a next step keeps its other spans; the kept columns are the kept spans'."""
    from traces.columns import columns_of

    trace = _steps(3)
    lone = Span(7, "compute", "WAIT", None, None, 0.2, 0.1)  # a rank that has no schedule spans at all
    trace.spans.append(lone)
    dropped = drop_warmup_step(trace)
    steps = _fresh(trace)
    second = {}
    for i, k in steps.items():
        if k == 1:
            s = trace.spans[i]
            second[s.rank] = min(second.get(s.rank, s.start), s.start)
    want = [s for i, s in enumerate(trace.spans)
            if not (steps.get(i) == 0 or (i not in steps and s.rank in second and s.start < second[s.rank]))]
    assert dropped.spans == want and lone in dropped.spans
    assert columns_of(dropped).start.tolist() == [s.start for s in want]
    assert columns_of(dropped).end.tolist() == [s.end for s in want]


def test_the_index_order_does_not_depend_on_what_was_asked_before():
    """step_index lists spans in key_groups' order on a trace whose steps were only computed (steps_of first or
    not: callers such as costmodel.local.runtime_fit add per step in that order), and in index order on a trace
    whose step arrays were given (the warm-up drop's)."""
    from traces.analysis.step_select import steps_of

    fresh = _steps(3)
    asked = Trace(spans=list(fresh.spans), meta=dict(fresh.meta))
    steps_of(asked)  # the step arrays, computed from the spans, kept on the trace
    assert list(step_index(asked).items()) == list(_fresh(fresh).items())
    dropped = drop_warmup_step(_steps(3))
    assert list(step_index(dropped)) == sorted(step_index(dropped))
