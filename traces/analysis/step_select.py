"""One step of a trace: which spans belong to step k, each step's makespan, and the representative step.

Schedule spans (traces.analysis.matching.schedule_spans) take their step from the instance order of their key
(traces.analysis.matching.step_index, as `mhcpipe compare` does). Every other span of a rank (WAIT, step and optimizer
ranges, kernels) belongs to the step whose window on that rank holds its start: from the rank's first schedule
span of the step to its first schedule span of the next step (so the waits that drain a step's sends at its end
stay in it). A step counts when it holds at least half the schedule spans of step 0 (a cut-off last step does
not), as in traces.analysis.compare.time_stats. Makespan of a step: end of its last minus start of its first schedule
span. `select_steps` cuts steps A..B out of a trace (`mhcpipe convert --steps`, and `--steps` on the analyses),
recording where the cut starts (meta first_step).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from traces.analysis.step_keys import (cut_ids, file_key_ids, keep_key_ids, keep_step_arrays, keyed_steps,
                                      step_arrays)
from traces.columns import columns_of
from traces.formats.npz import ColumnFile
from traces.trace import Trace, TraceError

_RANGE = re.compile(r"^(\d+)(?:\.\.(\d+))?$")  # --steps A..B or A


@dataclass(frozen=True)
class StepInfo:
    """The steps of a trace: span indices per counted step, their makespans, and the median step."""
    spans: dict[int, np.ndarray]  # step -> indices into trace.spans (schedule spans and the rest), int32: no int
    # object per span (10^7 spans, two traces: 0.7 GB)
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


NO_STEPS = ("the trace has no schedule spans named as in traces.md §5 (e.g. F/s3/mb7), so it has no steps to "
            "analyse; label ranges with the naming convention (NVTX or record_function)")


def steps_of(trace: Trace) -> StepInfo:
    """The steps of `trace` (module docstring), on its columns (traces.columns): 10^6 spans in a fraction of a
    second."""
    sched, sched_k = step_arrays(trace)  # int32: 10^7 spans, no dict
    if not len(sched):
        raise TraceError(NO_STEPS)
    cols = columns_of(trace)
    return _step_info(cols.rank, cols.start, cols.duration, sched, sched_k)


def _step_info(rank: np.ndarray, start: np.ndarray, duration: np.ndarray, sched: np.ndarray,
               sched_k: np.ndarray) -> StepInfo:
    """The steps from the spans' rank, start and duration columns and the schedule spans' indices and steps."""
    step_of = np.full(len(rank), -1, dtype=np.int32)
    step_of[sched] = sched_k
    count = np.bincount(sched_k)
    full = int(count[0])
    counted = [k for k in range(len(count)) if count[k] and count[k] >= 0.5 * full]
    # the step windows: per (rank, step) the start of its first schedule span, each rank's sorted by (start, step)
    rank_s, begin_s = rank[sched], start[sched]
    order = np.lexsort((begin_s, sched_k, rank_s))
    rk, kk, bb = rank_s[order], sched_k[order], begin_s[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = (rk[1:] != rk[:-1]) | (kk[1:] != kk[:-1])
    w_rank, w_step, w_t = rk[first], kk[first], bb[first]
    by_t = np.lexsort((w_step, w_t, w_rank))
    w_rank, w_step, w_t = w_rank[by_t], w_step[by_t], w_t[by_t]
    del rank_s, begin_s, order, rk, kk, bb, first  # 10^6-long temporaries: the peak memory is the point
    # every other span: the step whose window on its rank holds its start (before the first window: the first)
    rest = np.flatnonzero(step_of < 0)
    rest_rank = rank[rest]
    for r in np.unique(w_rank).tolist():
        lo, hi = np.searchsorted(w_rank, [r, r + 1])
        mine = rest[rest_rank == r]
        j = np.searchsorted(w_t[lo:hi], start[mine], side="right") - 1
        step_of[mine] = w_step[lo + np.maximum(j, 0)]
    keep = np.flatnonzero(np.isin(step_of, counted)).astype(np.int32)
    keep = keep[np.lexsort((keep, start[keep], step_of[keep]))]  # by step, then (start, index)
    sorted_steps = step_of[keep]
    is_sched = np.zeros(len(rank), dtype=bool)
    is_sched[sched] = True
    out, mk, t0 = {}, {}, {}
    want = np.asarray(counted, dtype=sorted_steps.dtype)  # one search for all steps (a scalar search casts the array)
    for k, a, b in zip(counted, np.searchsorted(sorted_steps, want, "left").tolist(),
                       np.searchsorted(sorted_steps, want, "right").tolist()):
        idx = keep[a:b]
        s_idx = idx[is_sched[idx]]
        out[k] = idx
        t0[k] = float(start[s_idx].min())
        mk[k] = float((start[s_idx] + duration[s_idx]).max()) - t0[k]
    return StepInfo(spans=out, makespan=mk, t0=t0)


def step_trace(trace: Trace, step: int | None = None, info: StepInfo | None = None) -> tuple[int, Trace]:
    """(step, the trace of that step alone); default: the median step."""
    info = info or steps_of(trace)
    k = info.median_step() if step is None else step
    if k not in info.spans:
        raise TraceError(f"--step {k}: the trace holds steps {', '.join(map(str, info.steps))} (counted from 0 "
                         "after any dropped warm-up step); pick one of them")
    meta = {**trace.meta, "step": k, "steps": len(info.steps)}
    return k, trace.subset(info.spans[k], meta)


def parse_steps(text: str) -> tuple[int, int]:
    m = _RANGE.match(text.strip())
    if m is None:
        raise ValueError(f"--steps {text!r}: write A..B (steps A to B, e.g. 3..7) or one step A")
    a = int(m.group(1))
    b = int(m.group(2)) if m.group(2) is not None else a
    if b < a:
        raise ValueError(f"--steps {text!r}: the last step {b} comes before the first {a}; write {b}..{a}")
    return a, b


def select_steps(trace: Trace, first: int, last: int) -> Trace:
    """Steps `first` to `last` of `trace` (steps counted as traces.analysis.step_select counts them, warm-up
    included), their spans in the file's order; meta `first_step` records where the cut starts."""
    keep, meta = _cut(steps_of(trace), trace.meta, first, last)
    return trace.subset(keep, meta)


def select_file_steps(cf: ColumnFile, first: int, last: int) -> Trace:
    """select_steps of a .npz trace (traces.formats.npz) found on its columns: Span objects are made for the
    steps kept only, so a 10^7-span run's steps A..B load in the memory of those steps."""
    sched, ids = file_key_ids(cf)
    if not len(sched):
        raise TraceError(NO_STEPS)
    cols = cf.cols
    sched_k = keyed_steps(sched, (ids,), cols["start"][sched])[1]
    info = _step_info(cols["rank"], cols["start"], cols["duration"], sched, sched_k)
    rows, meta = _cut(info, cf.meta, first, last)
    trace = cf.trace(rows, meta)
    keep_key_ids(trace, *cut_ids(sched, ids, rows))  # a key's id does not depend on the steps around it
    return trace


def file_trace(cf: ColumnFile) -> Trace:
    """Every span of a .npz trace, its step arrays found on the columns before the spans are made (the
    temporaries of the search gone before 10^7 spans exist)."""
    rows, ids = file_key_ids(cf)
    steps = keyed_steps(rows, (ids,), cf.cols["start"][rows])[1]
    trace = cf.trace()
    keep_step_arrays(trace, rows, steps)
    keep_key_ids(trace, rows, ids)  # matching.key_groups groups on them: no pass over the spans
    return trace


def _cut(info: StepInfo, meta: dict, first: int, last: int) -> tuple[np.ndarray, dict]:
    """The span indices of steps `first`..`last` in file order, and the cut's meta."""
    have = info.steps
    missing = [k for k in range(first, last + 1) if k not in info.spans]
    if missing:
        raise TraceError(f"--steps {first}..{last}: the trace holds steps {have[0]}..{have[-1]} (counted from 0, "
                         f"warm-up included); step {missing[0]} is not among them")
    keep = np.sort(np.concatenate([info.spans[k] for k in range(first, last + 1)])).astype(np.int64)
    offset = int(meta.get("first_step", 0))
    return keep, {**meta, "first_step": offset + first, "steps": last - first + 1}
