"""mHC's overhead attributed along the critical paths: given the baseline's and mHC's trace (both predicted, or
both measured, of the same schedule), how much of T_mHC - T_base each cause explains.

With L = the critical path's length and G its gaps (traces.analysis.critical_path; T = L + G for the analysed step), and
for every op v on mHC's path d_m(v) its duration, d_b(v) the same op's duration in the baseline (median over the
baseline's steps; 0 for an op the baseline does not have), exactly
    T_mHC - T_base = sum_v (d_m(v) - d_b(v))          the path's ops grew:
                         mhc_kernels     compute ops (F, I, B, W, FB) outside their recompute parts,
                         recompute       RC ops and RC parts inside backwards,
                         boundary_bytes  stage-boundary transfers, collectives and waits on the path;
                   + (sum_v d_b(v) - L_base)          bubble_change: mHC's path priced at baseline durations minus
                                                      the baseline's own path - the chain itself changed (other
                                                      ops, more of the pipeline's bubble on it);
                   + (G_mHC - G_base)                 host_gaps: the delays between ops on the paths.
Each cause is in the trace's time unit and in % of T_base.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from traces.analysis.critical_path import CriticalPath, critical_path
from traces.names import COMM_NODE_KINDS
from traces.analysis.replicas import one_replica
from traces.analysis.span_graph import build_span_graph
from traces.analysis.stage_chains import stage_chains
from traces.analysis.step_select import steps_of
from traces.trace import Trace, TraceError

CAUSES = ("mhc_kernels", "recompute", "boundary_bytes", "bubble_change", "host_gaps")


@dataclass
class PathOverhead:
    base_us: float  # the analysed steps' makespans
    mhc_us: float
    overhead_us: float
    overhead_pct: float
    causes_us: dict[str, float]  # sums to overhead_us
    causes_pct: dict[str, float]  # in % of base_us

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def node_medians(trace: Trace, schedule: Any = None) -> dict[tuple[int, str], tuple[float, float]]:
    """(rank, op label) -> (median duration, median recompute part) over the trace's steps."""
    acc: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    rep = one_replica(trace)  # what build_span_graph analyses: its steps and stage chains, once for all steps
    info, chains = steps_of(rep), stage_chains(rep, schedule)
    for k in steps_of(trace).steps:
        g = build_span_graph(rep, step=k, schedule=schedule, info=info, chains=chains)
        for n in g.nodes:
            acc[(n.rank, n.label)].append((n.duration, n.parts.get("RC", 0.0)))
    return {key: (float(np.median([d for d, _ in v])), float(np.median([r for _, r in v]))) for key, v in acc.items()}


def overhead_on_path(base: Trace, mhc: Trace, base_cp: CriticalPath | None = None,
                     mhc_cp: CriticalPath | None = None, schedule: Any = None) -> PathOverhead:
    base_cp = base_cp or critical_path(base, schedule)
    mhc_cp = mhc_cp or critical_path(mhc, schedule)
    med = node_medians(base, schedule)
    causes = dict.fromkeys(CAUSES, 0.0)
    at_base = 0.0
    for p in mhc_cp.path:
        d_b, rc_b = med.get((p.rank, p.label), (0.0, 0.0))
        at_base += d_b
        if p.kind in COMM_NODE_KINDS or p.kind == "WAIT":
            causes["boundary_bytes"] += p.duration_us - d_b
        elif p.kind == "RC":
            causes["recompute"] += p.duration_us - d_b
        else:
            rc_m = p.parts.get("RC", 0.0)
            causes["recompute"] += rc_m - rc_b
            causes["mhc_kernels"] += (p.duration_us - rc_m) - (d_b - rc_b)
    causes["bubble_change"] = at_base - base_cp.length_us
    causes["host_gaps"] = mhc_cp.gaps_us - base_cp.gaps_us
    total = mhc_cp.makespan_us - base_cp.makespan_us
    pct = (lambda x: 100.0 * x / base_cp.makespan_us) if base_cp.makespan_us > 0 else (lambda x: float("nan"))
    return PathOverhead(base_us=base_cp.makespan_us, mhc_us=mhc_cp.makespan_us, overhead_us=total,
                        overhead_pct=pct(total), causes_us=causes, causes_pct={k: pct(v) for k, v in causes.items()})


def compare_paths(pred: Trace, meas: Trace, baseline: tuple[Trace, Trace] | None = None) -> tuple[dict, list[str]]:
    """For `mhcpipe compare`: the predicted and measured critical paths (JSON-ready, without per-op slack), and
    with a baseline pair mHC's overhead along them; notes say what could not be computed."""
    out: dict[str, Any] = {}
    notes: list[str] = []
    cps: dict[str, CriticalPath] = {}
    for name, t in (("pred", pred), ("meas", meas)):
        try:
            cps[name] = critical_path(t)
            out[name] = cps[name].to_dict(max_slack=0)
        except TraceError as err:
            notes.append(f"critical path of the {'prediction' if name == 'pred' else 'measurement'}: {err}")
    if baseline is not None and cps:
        out["overhead_on_path"] = {}
        for name, base, t in (("pred", baseline[0], pred), ("meas", baseline[1], meas)):
            if name not in cps:
                continue
            try:
                out["overhead_on_path"][name] = overhead_on_path(base, t, mhc_cp=cps[name]).to_dict()
            except TraceError as err:
                notes.append(f"mHC overhead along the {name} critical path: {err}")
    return out, notes
