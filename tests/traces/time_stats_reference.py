"""The one-step-at-a-time rule that traces.analysis.time_stats replaced, kept as its oracle: spans as Python objects,
a step at a time, sums in listing order. test_time_stats.py asserts the columnar version gives the same floats."""
from __future__ import annotations

from bisect import bisect_right
from collections import Counter, defaultdict

import numpy as np

from traces.analysis.matching import key_groups, logical_stream
from traces.analysis.receive_wait import RECEIVE_KINDS, receive_wait
from traces.analysis.time_stats import TimeStats
from traces.trace import Span, Trace, union_length


def reference_time_stats(trace: Trace) -> TimeStats:
    by_step: dict[int, list[Span]] = defaultdict(list)
    groups = key_groups(trace)
    for members in groups.values():
        for k, i in enumerate(members):
            by_step[k].append(trace.spans[i])
    full = len(by_step.get(0, []))
    steps = sorted(k for k, spans in by_step.items() if len(spans) >= 0.5 * full)
    ranks = sorted({key[0] for key in groups})
    waits_recorded = bool(trace.meta.get("wait_spans"))
    mks: list[float] = []
    busy, idle, exposed = defaultdict(list), defaultdict(list), defaultdict(list)
    step_kt: list[Counter] = []
    step_waits: list = []
    for k in steps:
        spans = by_step[k]
        t0 = min(s.start for s in spans)
        mk = max(s.end for s in spans) - t0
        per_rank: dict = defaultdict(lambda: defaultdict(list))
        streams = [logical_stream(s) for s in spans]
        for s, ls in zip(spans, streams):
            per_rank[s.rank][ls].append((s.start, s.end))
        mks.append(mk)
        for r in ranks:
            comp = per_rank[r]["compute"] + per_rank[r]["hp"]
            b = union_length(comp)
            busy[r].append(b)
            idle[r].append(mk - b)
            exposed[r].append(union_length(comp + per_rank[r]["comm"]) - b)
        step_kt.append(_kind_times([(s, ls) for s, ls in zip(spans, streams) if ls != "comm"]))
        step_waits.append(None if waits_recorded else timeline_waits(spans, streams))

    def med(xs) -> float:
        return float(np.median(xs)) if len(xs) else 0.0

    rank_kind: dict = defaultdict(dict)
    kind_time: dict = defaultdict(float)
    for rk in sorted(set().union(*step_kt)) if step_kt else ():
        v = med([kt.get(rk, 0.0) for kt in step_kt])
        rank_kind[rk[0]][rk[1]] = v
        kind_time[rk[1]] += v
    return TimeStats(makespan_us=med(mks), makespan_min_us=min(mks, default=0.0), makespan_max_us=max(mks, default=0.0),
                     steps=len(steps), busy={r: med(v) for r, v in busy.items()},
                     idle={r: med(v) for r, v in idle.items()}, exposed_comm={r: med(v) for r, v in exposed.items()},
                     kind_time=dict(kind_time), rank_kind_time={r: rank_kind.get(r, {}) for r in ranks},
                     recv_wait=receive_wait(trace, ranks, step_waits))


def _kind_times(spans: list[tuple[Span, str]]) -> Counter:
    kt: Counter = Counter()
    top = _top_level([s for s, _ in spans])
    for s in top:
        kt[(s.rank, s.kind)] += s.duration
    top_ids = {id(s) for s in top}
    enclosing: dict = defaultdict(list)
    for s, ls in spans:
        if id(s) in top_ids:
            enclosing[(s.rank, ls)].append(s)
    starts = {k: [s.start for s in v] for k, v in enclosing.items()}
    for s, ls in spans:
        if "." not in s.kind or id(s) in top_ids:
            continue
        cands = enclosing.get((s.rank, ls), [])
        j = bisect_right(starts.get((s.rank, ls), []), s.start) - 1
        if j >= 0 and cands[j].end >= s.end and "." not in cands[j].kind:
            if cands[j].kind == "FB" and s.kind.split(".", 1)[0] in ("F", "B"):
                continue
            kt[(s.rank, s.kind)] += s.duration
            kt[(s.rank, cands[j].kind)] -= s.duration
    return kt


def _top_level(spans: list[Span]) -> list[Span]:
    out = []
    by_rank: dict = defaultdict(list)
    for s in spans:
        by_rank[s.rank].append(s)
    for items in by_rank.values():
        top_end = float("-inf")
        for s in sorted(items, key=lambda s: (s.start, -s.duration)):
            if s.end <= top_end:
                continue
            out.append(s)
            top_end = s.end
    return out


def timeline_waits(spans: list[Span], streams: list[str]) -> dict[int, float]:
    """One step: per rank, the idle stretches before compute, each counted up to the last receive completing
    inside it. `streams`: the spans' logical streams (compute, hp, comm)."""
    t0 = min(s.start for s in spans)
    busy: dict[int, list[tuple[float, float]]] = defaultdict(list)
    arrivals: dict[int, list[float]] = defaultdict(list)
    for s, ls in zip(spans, streams):
        if ls in ("compute", "hp"):
            busy[s.rank].append((s.start, s.end))
        elif s.kind.split(".", 1)[0] in RECEIVE_KINDS:
            arrivals[s.rank].append(s.end)
    out = {}
    for r, intervals in busy.items():
        waited, free = 0.0, t0
        ends = sorted(arrivals.get(r, ()))
        for start, end in sorted(intervals):
            if start > free:
                eps = 1e-9 * max(1.0, abs(start))
                inside = [a for a in ends if free < a <= start + eps]
                if inside:
                    waited += min(max(inside), start) - free
            free = max(free, end)
        out[r] = waited
    return out
