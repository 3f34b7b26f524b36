"""One step of a trace: which spans belong to step k, each step's makespan, and the representative step.

Schedule spans (traces.analysis.matching.schedule_spans) take their step from the instance order of their key
(traces.analysis.matching.step_index, as `mhcpipe compare` does). Every other span of a rank (WAIT, step and optimizer
ranges, kernels) belongs to the step whose window on that rank holds its start: from the rank's first schedule
span of the step to its first schedule span of the next step (so the waits that drain a step's sends at its end
stay in it). A step counts when it holds at least half the schedule spans of step 0 (a cut-off last step does
not), as in traces.analysis.compare.time_stats. Makespan of a step: end of its last minus start of its first schedule
span.
"""
from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass

from traces.analysis.matching import step_index
from traces.trace import Trace, TraceError


@dataclass(frozen=True)
class StepInfo:
    """The steps of a trace: span indices per counted step, their makespans, and the median step."""
    spans: dict[int, list[int]]  # step -> indices into trace.spans (schedule spans and the rest)
    makespan: dict[int, float]  # step -> makespan in the trace's time unit
    t0: dict[int, float]  # step -> start of its first schedule span

    @property
    def steps(self) -> list[int]:
        return sorted(self.spans)

    def median_step(self) -> int:
        """The step whose makespan is the median (for an even count the lower of the two middle ones), so a
        single-step analysis describes a typical step, not the fastest or the slowest."""
        order = sorted(self.steps, key=lambda k: (self.makespan[k], k))
        return order[(len(order) - 1) // 2]


def steps_of(trace: Trace) -> StepInfo:
    steps = step_index(trace)
    if not steps:
        raise TraceError("the trace has no schedule spans named as in traces.md §5 (e.g. F/s3/mb7), so it has no "
                         "steps to analyse; label ranges with the naming convention (NVTX or record_function)")
    by_step: dict[int, list[int]] = defaultdict(list)
    for i, k in steps.items():
        by_step[k].append(i)
    full = len(by_step.get(0, ()))
    counted = sorted(k for k, idx in by_step.items() if len(idx) >= 0.5 * full)
    # per rank: the start of its first schedule span in each step (the step windows)
    spans = trace.spans
    begin = [s.start for s in spans]  # list lookups below, not attribute reads per span and comparison
    rank = [s.rank for s in spans]
    first: dict[tuple[int, int], float] = {}  # (rank, step) -> its first schedule span's start
    for i, k in steps.items():
        key = (rank[i], k)
        cur = first.get(key)
        if cur is None or begin[i] < cur:
            first[key] = begin[i]
    firsts: dict[int, dict[int, float]] = defaultdict(dict)
    for (r, k), t in first.items():
        firsts[r][k] = t
    windows = {r: sorted((t, k) for k, t in f.items()) for r, f in firsts.items()}
    starts = {r: [t for t, _ in w] for r, w in windows.items()}  # once per rank, not once per span
    scheduled = bytearray(len(spans))
    for i in steps:
        scheduled[i] = 1
    for i, (r, t, sched) in enumerate(zip(rank, begin, scheduled)):
        if sched or r not in windows:
            continue
        j = bisect_right(starts[r], t) - 1
        by_step[windows[r][max(j, 0)][1]].append(i)
    out, mk, t0 = {}, {}, {}
    for k in counted:
        idx = sorted(by_step[k])
        idx.sort(key=begin.__getitem__)  # stable: by (start, index)
        sched = [i for i in idx if i in steps]
        out[k] = idx
        t0[k] = min(begin[i] for i in sched)
        mk[k] = max(spans[i].end for i in sched) - t0[k]
    return StepInfo(spans=out, makespan=mk, t0=t0)


def step_trace(trace: Trace, step: int | None = None, info: StepInfo | None = None) -> tuple[int, Trace]:
    """(step, the trace of that step alone); default: the median step."""
    info = info or steps_of(trace)
    k = info.median_step() if step is None else step
    if k not in info.spans:
        raise TraceError(f"--step {k}: the trace holds steps {', '.join(map(str, info.steps))} (counted from 0 "
                         "after any dropped warm-up step); pick one of them")
    meta = {**trace.meta, "step": k, "steps": len(info.steps)}
    return k, Trace(spans=[trace.spans[i] for i in info.spans[k]], meta=meta)
