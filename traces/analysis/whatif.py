"""What-if replay: re-time a trace's operations through the same dependencies and predict the step.

    whatif(trace, {"comm": 0.5, "mhc": 0.7}) -> WhatIf (step_us: the predicted step time)

Each counted step's dependency graph (traces.analysis.span_graph) is replayed (traces.analysis.replay) with every
operation's
duration scaled by the factors of its categories, the recorded delays between operations kept (scaled only by
`gap`). Unscaled, the replay reproduces each step's recorded makespan (`reproduction_error_pct` states how
closely: floating point only). `step_us` and `measured_step_us` are medians over the steps.

Categories (SCALE_HELP): an operation's factor is the product of those that apply to it.
  comm        every communication op: stage-boundary transfers, all-to-alls, gradient all-reduces, and the
              time an op was blocked on an exchange posted inside it (an expert layer's all-to-all)
  p2p, a2a, allreduce   only transfers / only all-to-alls / only gradient all-reduces
  wait        a wait's own time after the op it waited for arrived
  F, I, B, W, FB        compute ops of that kind (the halves of a measured F&B pair count as F and B; a pair
              recorded as one span takes F's and B's factors on its halves' shares, from the rank's lone F and B)
  recompute   recomputation (RC spans and RC parts inside backwards)
  mhc         mHC's share of the compute ops: the mHC kernel parts the trace records (coef, sinkhorn, pre,
              post_res); with a baseline trace (--baseline, the same schedule without mHC), each op's measured
              A/B share instead, 1 - median(baseline op) / median(mHC op) per (rank, op) (recorded parts and
              recompute excluded) - the runtime times only post+res on its own, the rest of mHC runs inside
              the ops
  <part>      a kernel part the trace records (e.g. post_res, attn, mlp): its time inside its op
  gap         the recorded delays between operations (launch, host and OS time)
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from traces.analysis.critical_path import MHC_PARTS, CriticalPath, from_timing
from traces.analysis.matching import key_groups, span_key
from traces.analysis.replay import critical_chain, replay
from traces.analysis.replicas import one_replica
from traces.analysis.span_graph import SpanGraph, build_span_graph
from traces.analysis.stage_chains import stage_chains
from traces.analysis.step_pool import map_steps
from traces.analysis.step_select import steps_of
from traces.trace import Trace, TraceError

OP_KINDS = ("F", "I", "B", "W", "FB")
FIXED_CATEGORIES = ("comm", "p2p", "a2a", "allreduce", "wait", *OP_KINDS, "recompute", "mhc", "gap")
SCALE_HELP = __doc__.split("Categories (SCALE_HELP):", 1)[1].split("\n", 1)[1].rstrip()


def parse_scales(items: list[str]) -> dict[str, float]:
    """`["comm=0.5", "mhc=0"]` -> {"comm": 0.5, "mhc": 0.0}; one-line ValueError naming the bad item."""
    out: dict[str, float] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--scale {item!r}: write KIND=FACTOR, e.g. --scale comm=0.5")
        try:
            f = float(raw)
        except ValueError:
            raise ValueError(f"--scale {item!r}: {raw!r} is not a number") from None
        if not np.isfinite(f) or f < 0:
            raise ValueError(f"--scale {item!r}: the factor must be a finite number >= 0 (0 removes the time)")
        out[key] = out.get(key, 1.0) * f
    return out


def check_kinds(scales: dict[str, float], known_parts: set[str]) -> None:
    known = set(FIXED_CATEGORIES) | known_parts
    bad = sorted(k for k in scales if k not in known)
    if bad:
        raise ValueError(f"--scale {bad[0]}: unknown kind; use one of {', '.join(sorted(known))} (parts come from "
                         "the trace's kernel spans)")


@dataclass
class WhatIf:
    scales: dict[str, float]
    measured_step_us: float  # median over the steps of the recorded makespans
    replay_step_us: float  # median of the unscaled replays (= measured up to floating point)
    step_us: float  # median of the scaled replays: the prediction
    reproduction_error_pct: float  # max over steps of |unscaled replay - recorded| / recorded
    steps: list[dict[str, float]]
    mhc_source: str
    before: CriticalPath  # the median step's critical path, recorded and after scaling
    after: CriticalPath
    notes: list[str] = field(default_factory=list)
    baseline_step_us: float | None = None  # --baseline: its recorded step (median over its steps), same reading

    def to_dict(self) -> dict[str, Any]:
        return {"scales": self.scales, "step_us": self.step_us, "measured_step_us": self.measured_step_us,
                "baseline_step_us": self.baseline_step_us,
                "replay_step_us": self.replay_step_us, "reproduction_error_pct": self.reproduction_error_pct,
                "change_pct": 100.0 * (self.step_us / self.measured_step_us - 1) if self.measured_step_us else None,
                "steps": self.steps, "mhc_source": self.mhc_source, "notes": self.notes,
                "critical_path_before": self.before.to_dict(max_slack=0),
                "critical_path_after": self.after.to_dict(max_slack=0)}


def whatif(trace: Trace, scales: dict[str, float], baseline: Trace | None = None, schedule: Any = None,
           baseline_name: str = "the baseline trace", jobs: int | None = 1) -> WhatIf:
    """`jobs`: processes the steps are spread over (traces.analysis.step_pool; None: every CPU this process may
    use); the result does not depend on it."""
    info = steps_of(trace)
    rep = one_replica(trace)  # what build_span_graph analyses: its steps and stage chains, once for all steps
    rep_info = info if rep is trace else steps_of(rep)
    chains = stage_chains(rep, schedule)
    share, source = _mhc_shares(trace, baseline, baseline_name) if baseline is not None else (None, "")
    median_k = info.median_step()
    steps = len(info.steps)

    def one_step(k: int) -> tuple[dict, set[str], dict]:
        # one step's graph at a time: 10^3 steps of a long run do not sit in memory together
        g = build_span_graph(rep, step=k, schedule=schedule, info=rep_info, chains=chains)
        base = replay(g)
        median = g.step == median_k  # the one step whose critical path is reported, with its parts
        dur, parts = scaled_durations(g, scales, share, with_parts=median)
        tm = replay(g, dur, gap_scale=scales.get("gap", 1.0))
        row = {"step": g.step, "measured_us": g.makespan, "replay_us": base.makespan, "predicted_us": tm.makespan}
        ends = {}
        if median:
            ends = {"before": from_timing(base, steps), "after": from_timing(tm, steps, critical_chain(tm), parts)}
        return row, {p for n in g.nodes for p in n.parts}, ends

    rows, before_after, known = [], {}, set()
    for row, parts_seen, ends in map_steps(one_step, info.steps, jobs):
        rows.append(row)
        known |= parts_seen
        before_after = ends or before_after
    check_kinds(scales, known)  # a part no step records: refused, whatever was computed
    source = source or _recorded_source(known)
    err = max(abs(r["replay_us"] - r["measured_us"]) / r["measured_us"] for r in rows if r["measured_us"] > 0)
    def med(key: str) -> float:
        return float(np.median([r[key] for r in rows]))

    base_step = None
    if baseline is not None:  # the baseline's own recorded step, read the same way (median over its steps)
        brep = one_replica(baseline)
        binfo, bchains = steps_of(brep), stage_chains(brep, schedule)
        base_step = float(np.median(map_steps(lambda k: build_span_graph(brep, step=k, schedule=schedule, info=binfo,
                                                                         chains=bchains).makespan,
                                              steps_of(baseline).steps, jobs)))
    return WhatIf(scales=dict(scales), measured_step_us=med("measured_us"), replay_step_us=med("replay_us"),
                  step_us=med("predicted_us"), reproduction_error_pct=100.0 * err, steps=rows, mhc_source=source,
                  baseline_step_us=base_step, **before_after)


def _recorded_source(parts: set[str]) -> str:
    rec = sorted(parts & MHC_PARTS)
    return (f"the mHC kernel parts the trace records ({', '.join(rec)}); the rest of mHC's cost runs inside the ops"
            if rec else "none recorded: the trace has no mHC kernel parts, so mhc scales nothing (give a baseline)")


def node_factor(kind: str, lane: str, scales: dict[str, float]) -> float:
    f = scales.get(kind, 1.0) if kind in OP_KINDS else 1.0
    if kind == "RC":
        f *= scales.get("recompute", 1.0)
    if lane == "comm":
        f *= scales.get("comm", 1.0)
        f *= scales.get({"P2P": "p2p", "RG": "allreduce"}.get(kind, "a2a"), 1.0)
    if kind == "WAIT":
        f *= scales.get("wait", 1.0)
    return f


def part_factor(part: str, scales: dict[str, float], ab_mhc: bool) -> float:
    f = scales.get(part, 1.0)
    if part in MHC_PARTS and not ab_mhc:
        f *= scales.get("mhc", 1.0)
    if part == "RC":
        f *= scales.get("recompute", 1.0)
    if part == "wait":  # the op blocked on an exchange posted inside it (an expert layer's all-to-all)
        f *= scales.get("comm", 1.0) * scales.get("a2a", 1.0)
    return f


def scaled_durations(g: SpanGraph, scales: dict[str, float], share: dict[tuple, float] | None = None,
                     with_parts: bool = True) -> tuple[np.ndarray, list[dict[str, float]]]:
    """Per node the scaled duration and its scaled parts (`with_parts=False`: durations only, the parts list
    empty). `share`: span key -> mHC's A/B share of that op."""
    dur = [0.0] * len(g.nodes)
    parts_out: list[dict[str, float]] = []
    f_mhc = scales.get("mhc", 1.0)
    halves = fb_half_shares(g) if ("F" in scales or "B" in scales) else {}
    factors: dict[tuple[str, str], float] = {}  # (kind, lane) -> node_factor: a few pairs, 10^3 nodes
    for n in g.nodes:
        f = factors.get((n.kind, n.lane))
        if f is None:
            f = factors[(n.kind, n.lane)] = node_factor(n.kind, n.lane, scales)
        if not n.parts and share is None and n.id not in halves:  # most nodes: the rule below without parts or
            dur[n.id] = f * (max(n.duration, 0.0) + f_mhc * 0.0)  # A/B share, the same floats
            if with_parts:
                parts_out.append({})
            continue
        if n.id in halves:  # an F&B pair recorded as one span: its halves' shares take F's and B's factors
            sf = halves[n.id]
            f *= sf * scales.get("F", 1.0) + (1.0 - sf) * scales.get("B", 1.0)
        m = 0.0
        if share is not None and n.lane == "compute" and n.kind != "WAIT" and len(n.spans) == 1:
            other = sum(t for p, t in n.parts.items() if p not in MHC_PARTS)
            m = max(0.0, share.get(span_key(g.trace.spans[n.spans[0]]), 0.0) * (n.duration - other))
        parts = {p: t * part_factor(p, scales, share is not None) * f for p, t in n.parts.items()
                 if not (share is not None and p in MHC_PARTS)}
        rest = n.duration - m - sum(t for p, t in n.parts.items() if p in parts)
        dur[n.id] = f * (max(rest, 0.0) + f_mhc * m) + sum(parts.values())
        if m:
            parts["mhc (A/B)"] = f * f_mhc * m
        if with_parts:
            parts_out.append(parts)
    return np.asarray(dur), parts_out


def fb_half_shares(g: SpanGraph) -> dict[int, float]:
    """Per F&B pair recorded as one span (a prediction's FB): the forward half's share of it, from the same rank's
    lone ops - median F of the forward's stage / (that + median backward of the backward's stage, B or I + W) -
    as the simulator prices a pair (schedules.Durations: FB = F + B). Pairs without lone ops of both stages are
    left out (only `FB` scales them)."""
    pairs = [n for n in g.nodes if n.kind == "FB" and n.partner is not None]
    if not pairs:  # most traces record a pair's halves, or run no pairs
        return {}
    lone: dict[tuple[int, str, int], list[float]] = defaultdict(list)
    for n in g.nodes:
        if n.kind in ("F", "B", "I", "W") and n.stage is not None and len(n.spans) == 1 and \
                "." not in g.trace.spans[n.spans[0]].kind:
            lone[(n.rank, n.kind, n.stage)].append(n.duration)
    med = {k: statistics.median(v) for k, v in lone.items()}  # numpy's median costs 30 us a call, on 2-20 values
    out = {}
    for n in pairs:
        f = med.get((n.rank, "F", n.stage))
        b = med.get((n.rank, "B", n.partner[0]))
        if b is None and (n.rank, "I", n.partner[0]) in med:
            b = med[(n.rank, "I", n.partner[0])] + med.get((n.rank, "W", n.partner[0]), 0.0)
        if f is not None and b is not None and f + b > 0:
            out[n.id] = f / (f + b)
    return out


def _mhc_shares(trace: Trace, baseline: Trace, name: str) -> tuple[dict[tuple, float], str]:
    """Per op key (rank, kind, stage, mb, partner, part): mHC's share of the op's time outside its recorded
    non-mHC parts, from the medians over steps of the same op in the mHC trace and the baseline trace."""
    mg, bg = key_groups(trace), key_groups(baseline)
    if not set(mg) & set(bg):
        raise TraceError("--baseline: the baseline trace shares no op (rank, kind, stage, micro-batch) with the "
                         "trace; give a run of the same schedule without mHC")
    rc = _rc_inside(trace)
    out: dict[tuple, float] = {}
    for key, idx in mg.items():
        if key not in bg or key[1] in ("SEND_F", "RECV_F", "SEND_B", "RECV_B"):
            continue
        m = float(np.median([trace.spans[i].duration - rc.get(i, 0.0) for i in idx.tolist()]))
        b = float(np.median([baseline.spans[i].duration for i in bg[key].tolist()]))
        if m > 0:
            out[key] = min(1.0, max(0.0, 1.0 - b / m))
    return out, f"A/B: each op's share 1 - median(baseline) / median(mHC) over steps, per (rank, op), against {name}"


def _rc_inside(trace: Trace) -> dict[int, float]:
    """Span index -> recompute time nested inside it (RC spans inside the same rank's op of that stage and mb)."""
    rcs = defaultdict(list)
    for s in trace.spans:
        if s.kind == "RC":
            rcs[(s.rank, s.stage, s.mb)].append(s)
    out = {}
    if not rcs:
        return out
    for i, s in enumerate(trace.spans):
        for r in rcs.get((s.rank, s.stage, s.mb), ()):
            if s.kind != "RC" and s.start <= r.start and r.end <= s.end:
                out[i] = out.get(i, 0.0) + r.duration
    return out
