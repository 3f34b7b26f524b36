"""Discrete-event simulation of a schedule: actions + durations -> a `traces.Trace` and the schedule's headline
numbers (makespan, busy and idle time per rank, peak live activations).

The execution semantics and the engine are `schedules.engine`'s; this module validates the schedule first,
prices actions from `Durations` (or the caller's cost functions) and turns the engine's spans into a trace.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from schedules.durations import Durations
from schedules.engine import run_engine
from schedules.ir import Action, Kind, Schedule
from schedules.lowering import lower_comms
from schedules.memo import derived
from schedules.registry import trace_meta
from schedules.replay import run_without_spans
from schedules.validate import check_structure, raise_deadlock
from traces.trace import Trace


@dataclass
class SimResult:
    """What `simulate` reports: the predicted trace and the schedule's headline numbers."""

    trace: Trace
    makespan: float
    busy: dict[int, float]
    idle: dict[int, float]
    peak_activations: dict[int, int]
    # stage -> end of the last action writing its gradients (W, I, B, an F&B's B half), with or without spans
    grad_done: dict[int, float] | None = None

    @property
    def bubble_fraction(self) -> float:
        total = self.makespan * len(self.idle)
        return sum(self.idle.values()) / total if total else 0.0

    def summary(self) -> str:
        lines = [f"makespan {self.makespan:g}, bubble {100 * self.bubble_fraction:.1f}% of rank-time",
                 "rank  busy      idle      peak live activations (chunks)"]
        for r in sorted(self.idle):
            lines.append(f"{r:>4}  {self.busy[r]:<8g}  {self.idle[r]:<8g}  {self.peak_activations[r]}")
        return "\n".join(lines)


def peak_live_activations(schedule: Schedule) -> dict[int, int]:
    """Per rank, the most chunk activations alive at once in program order: alive from the start of a chunk's F
    to the end of its B or I (an overlapped F&B holds its forward's activation before freeing the backward's)."""
    peaks = {}
    KF, KFB, KI, KB = Kind.F, Kind.FB, Kind.I, Kind.B
    for r, acts in enumerate(schedule.actions):
        live = peak = 0
        for a in acts:
            kind = a[0]
            if kind is KF or kind is KFB:
                live += 1
                if live > peak:
                    peak = live
                if kind is KFB:
                    live -= 1
            elif kind is KI or kind is KB:
                live -= 1
        peaks[r] = peak
    return peaks


def simulate(schedule: Schedule, durations: Durations | None = None, *,
             compute_time: Callable[[Action], float] | None = None,
             transfer_time: Callable[[Action], float] | None = None,
             fb_timing: Callable[[Action, float, float], tuple[float, float, float]] | None = None,
             p2p: str = "commit", validate: bool = True, time_unit: str = "us", record: bool = True) -> SimResult:
    """Simulate `schedule` (lowered here if it is compute-only) and return its predicted trace and numbers.

    `durations` prices actions by kind (default: unit costs, B = I + W, FB = F + B, free P2P);
    `compute_time`/`transfer_time` override it per action (the cost model passes its own); `fb_timing` and
    `p2p` are the engine's (an F&B pair that releases its outputs as they are ready; P2P semantics).
    `record=False`: the trace holds no spans (the tuner needs the step's numbers only, not 10^5 spans).
    """
    durations = durations or Durations()
    if validate:  # once per schedule object: predict simulates one schedule at four prices
        lowered = derived(schedule, "checked and lowered", lambda: check_structure(schedule))
    else:
        lowered = schedule if schedule.lowered else lower_comms(schedule)
    compute_time, transfer_time = compute_time or durations.compute, transfer_time or durations.transfer
    if record:
        result = run_engine(lowered, compute_time, transfer_time, fb_timing=fb_timing, p2p=p2p)
    else:  # no spans: from its second run on, a schedule's rerun replays the engine's order (schedules.replay)
        result = run_without_spans(lowered, compute_time, transfer_time, fb_timing=fb_timing, p2p=p2p)
    if not result.completed:
        raise_deadlock(lowered, result.blocked)
    meta = {"source": "simulated", "time_unit": time_unit, "pipelines": [list(p) for p in schedule.pipelines],
            "schedule": trace_meta(schedule.kind, schedule.num_ranks, schedule.num_microbatches),
            # how the trace was made, for readers that rebuild its dependencies (traces.analysis.span_graph)
            "p2p": p2p, "fb_release_inside_pair": fb_timing is not None}
    trace = Trace(spans=result.spans, meta=meta)
    makespan = max(result.end, default=0.0)
    busy = dict(enumerate(result.busy))
    idle = {r: makespan - b for r, b in busy.items()}
    return SimResult(trace, makespan, busy, idle,
                     dict(derived(schedule, "peak live activations", lambda: peak_live_activations(schedule))),
                     {s: v for s, v in enumerate(result.grad_done) if v is not None})
