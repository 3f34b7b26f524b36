"""The critical path of a step across ranks and streams: which operations and transfers set the step time.

`critical_path(trace)` builds the step's dependency graph (traces.analysis.span_graph: program order per rank, the
schedule's data edges, SEND/RECV pairs, channel order, waits), replays it with the recorded durations
(traces.analysis.replay; this reproduces every recorded start) and walks back the chain of binding inputs from the op
that ends last. Works on predicted traces (schedules.simulate, the cost model; one step) and measured ones (the
step with the median makespan, or `step`).

    makespan = length (time the path's ops ran) + gaps (delays between them: launch and host time, the OS)
A trace from schedules.simulate has no gaps: length = makespan. Attribution of the length: per op kind (F, I, B,
W, FB, RC, P2P = stage-boundary transfers, A2A_*/RG = collectives, WAIT = a wait's own time after its op
arrived), per rank, per stream (compute / comm), per phase (fill: a rank's ops before its first backward;
drain: after its last forward; steady: between), and per part of the ops (mHC kernels, recompute) inside them.
exposed_comm_us = transfer and collective time on the path, plus the time the path's ops were blocked inside
them on an exchange they posted (part "wait"). slack: per op, how much later it could end without delaying the
step (0 on the path).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from traces.analysis.replay import Chain, Timing, critical_chain, replay, slack
from traces.analysis.span_graph import SpanGraph, build_span_graph
from traces.names import COMM_NODE_KINDS
from traces.trace import Span, Trace

MHC_PARTS = frozenset({"coef", "sinkhorn", "pre", "post_res"})  # traces.md §5 KERNELs of mHC (traces.drawing.view too)
PHASES = ("fill", "steady", "drain")


@dataclass
class PathStep:
    """One op of the path; times in the trace's unit relative to the step's start."""
    label: str
    rank: int
    stream: str
    kind: str
    phase: str
    start_us: float
    duration_us: float
    gap_before_us: float
    parts: dict[str, float] = field(default_factory=dict)  # time of kernel parts / recompute inside the op
    spans: list[Span] = field(default_factory=list, repr=False)  # the trace spans it stands for (not in JSON)


@dataclass
class CriticalPath:
    step: int
    steps: int
    makespan_us: float
    length_us: float
    gaps_us: float
    exposed_comm_us: float  # transfers and collectives on the path
    wait_us: float  # waits' own time on the path (after their op arrived)
    by_kind: dict[str, float]
    by_rank: dict[int, float]
    by_stream: dict[str, float]
    by_phase: dict[str, float]
    parts: dict[str, float]  # parts inside the path's ops: mHC kernels (and "mhc", their sum), RC, ...
    gaps_by_rank: dict[int, float]  # the path's gaps, on the rank of the op they delayed (tail and lead: "step")
    path: list[PathStep]
    slack: dict[tuple[int, str], float]  # (rank, op label) -> slack
    time_unit: str = "us"
    t0_us: float = 0.0  # the step's start on the trace's time axis (PathStep.start_us counts from here)
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    scope: str = ""  # which pipeline of a data-parallel run the path runs through (traces/analysis/replicas.py)
    wire_us: dict[str, float] = field(default_factory=dict)
    global_ranks: dict[int, int] = field(default_factory=dict)  # a data-parallel run: pipeline rank -> global rank

    def to_dict(self, max_slack: int | None = None) -> dict[str, Any]:
        """JSON-ready; `slack` as a list sorted by slack (the first `max_slack` entries, all if None)."""
        sl = sorted(({"rank": r, "label": lab, "slack_us": v} for (r, lab), v in self.slack.items()),
                    key=lambda d: (d["slack_us"], d["rank"], d["label"]))
        return {
            "step": self.step, "steps": self.steps, "time_unit": self.time_unit, "t0_us": self.t0_us,
            "makespan_us": self.makespan_us, "length_us": self.length_us, "gaps_us": self.gaps_us,
            "exposed_comm_us": self.exposed_comm_us, "wait_us": self.wait_us,
            "by_kind": self.by_kind, "by_rank": {str(k): v for k, v in self.by_rank.items()},
            "by_stream": self.by_stream, "by_phase": self.by_phase, "parts": self.parts,
            "gaps_by_rank": {str(k): v for k, v in self.gaps_by_rank.items()},
            "path": [{k: v for k, v in vars(p).items() if k != "spans"} for p in self.path],
            "slack": sl if max_slack is None else sl[:max_slack],
            "violations": self.violations, "notes": self.notes, "p2p_wire_us": self.wire_us, "scope": self.scope,
        }


def critical_path(trace: Trace, schedule: Any = None, step: int | None = None) -> CriticalPath:
    """The critical path of one step of `trace`. `schedule`: optionally the lowered schedules.Schedule the trace
    ran (exact receive posts for predicted traces); `step`: default the step with the median makespan."""
    g = build_span_graph(trace, step=step, schedule=schedule)
    cp = from_timing(replay(g), steps=int(g.trace.meta.get("steps", 1)))
    ranks = g.trace.meta.get("global_ranks")
    if ranks:  # a data-parallel run: the slowest replica's pipeline, its ranks numbered within the pipeline
        cp.global_ranks = {int(p): int(r) for p, r in ranks.items()}
        cp.scope = (f"data-parallel replica {g.trace.meta['replica']} (the slowest), pipeline ranks "
                    + ", ".join(f"{p} = global {r}" for p, r in sorted(ranks.items())))
    return cp


def from_timing(tm: Timing, steps: int = 1, chain: Chain | None = None,
                node_parts: list[dict[str, float]] | None = None) -> CriticalPath:
    """The path of a (possibly re-timed) replay; `node_parts`: the parts of each node under that replay
    (default: as recorded)."""
    g = tm.graph
    node_parts = node_parts or [n.parts for n in g.nodes]
    ch = chain or critical_chain(tm)
    tol = 1e-9 * max(1.0, abs(tm.makespan))
    phase = _phases(g, tm, tol)
    by_kind: dict[str, float] = defaultdict(float)
    by_rank: dict[int, float] = defaultdict(float)
    by_stream: dict[str, float] = defaultdict(float)
    by_phase: dict[str, float] = dict.fromkeys(PHASES, 0.0)
    parts: dict[str, float] = defaultdict(float)
    gaps_by_rank: dict[Any, float] = defaultdict(float)
    steps_out: list[PathStep] = []
    for v, gap, d in zip(ch.nodes, ch.gap_before, ch.on_path):
        n = g.nodes[v]
        by_kind[n.kind] += d
        by_rank[n.rank] += d
        by_stream[n.lane] += d
        by_phase[phase[v]] += d
        share = d / tm.dur[v] if tm.dur[v] > 0 else 0.0  # a pair on the path only up to a release: its share
        for p, t in node_parts[v].items():
            parts[p] += t * share
            if p in MHC_PARTS:
                parts["mhc"] += t * share
        gaps_by_rank[n.rank] += gap
        steps_out.append(PathStep(n.label, n.rank, n.lane, n.kind, phase[v], float(tm.start[v] - g.t0), d, gap,
                                  {p: t * share for p, t in node_parts[v].items()},
                                  [g.trace.spans[i] for i in n.spans]))
    gaps_by_rank["step end"] = ch.tail
    sl = slack(tm)
    slack_map = {(n.rank, n.label): float(sl[n.id]) for n in g.nodes}
    return CriticalPath(
        step=g.step, steps=steps, makespan_us=tm.makespan, length_us=ch.length, gaps_us=ch.gaps,
        exposed_comm_us=sum(v for k, v in by_kind.items() if k in COMM_NODE_KINDS) + parts.get("wait", 0.0),
        wait_us=by_kind.get("WAIT", 0.0), by_kind=dict(by_kind), by_rank=dict(sorted(by_rank.items())),
        by_stream=dict(by_stream), by_phase=by_phase, parts=dict(parts), gaps_by_rank=dict(gaps_by_rank),
        path=steps_out, slack=slack_map, time_unit=str(g.trace.meta.get("time_unit", "us")), t0_us=g.t0,
        violations=list(g.violations), notes=list(g.notes), wire_us=dict(g.wire_us))


def _phases(g: SpanGraph, tm: Timing, tol: float) -> list[str]:
    """fill / steady / drain per node, from its rank's first backward start and last forward end."""
    first_bwd: dict[int, float] = {}
    last_fwd: dict[int, float] = {}
    for n in g.nodes:
        halves = {h for h, _, _ in n.halves()}
        if halves & {"B", "W"}:
            first_bwd[n.rank] = min(first_bwd.get(n.rank, np.inf), tm.start[n.id])
        if "F" in halves:
            last_fwd[n.rank] = max(last_fwd.get(n.rank, -np.inf), tm.end[n.id])
    out = []
    for n in g.nodes:
        if tm.end[n.id] <= first_bwd.get(n.rank, np.inf) + tol:
            out.append("fill")
        elif tm.start[n.id] >= last_fwd.get(n.rank, np.inf) - tol:
            out.append("drain")
        else:
            out.append("steady")
    return out


def path_spans(cp: CriticalPath) -> list[Span]:
    """The spans of the path in path order (a transfer gives its SEND and its RECV), for highlighting."""
    return [s for p in cp.path for s in p.spans]
