"""What one simulated step is made of, beyond `predict`'s summary: the residual side's HBM bytes, the stage-boundary
bytes, the expert all-to-all time left exposed inside actions, and the critical path through the step.

Shape letters: T tokens per micro-batch, C hidden, n residual streams, d bytes per element, L sub-layers of a
stage, L_r sub-layers per recompute block, P pipeline ranks.

* Residual bytes: every compute action of the schedule adds the HBM bytes of its residual-side kernels (groups
  "mhc" and "recompute": the kernel I/O of mhc.md §4 / costmodel.md §2.2). F moves the forward kernels of its
  stage, I and B the backward ones (with the recompute of each block of L_r sub-layers when recompute is on,
  and the backward of expand/contract at a pipeline's ends), W none, an F&B pair its F's plus its B's. For the
  plain residual these are the adds (3C per sub-layer and pass) and its recompute, if any.
* Boundary bytes: stage-boundary messages in the simulated trace x T n C d (comm.boundary_bytes).
* Exposed all-to-all: per action, the expert all-to-all time with no compute running (overlap.OverlapResult
  .exposed_comm of the action's kernel simulation), summed over a rank's actions; exposed P2P is predict's
  `exposed_comm_us` (comm spans not covered by compute).
* Critical path: traces.analysis.critical_path (the step's span graph replayed, walked back from the op that ends last),
  summed per action kind, communication and gaps.
"""
from __future__ import annotations

from costmodel.physics.mhc_cost import recompute_kernels, residual_kernels, stack_ends, stage_entry
from costmodel.physics.ops import Kernel
from costmodel.pricing.pricer import Pricer
from schedules.ir import Kind, Schedule
from schedules.simulate import SimResult
from traces.analysis.critical_path import critical_path
from traces.names import COMM_NODE_KINDS
from traces.trace import Span

_COMPUTE = ("F", "I", "W", "B", "FB")


# ---- residual-side HBM bytes ---------------------------------------------------------------------------------
RESIDUAL_GROUPS = ("mhc", "recompute")
"""Kernel groups of the residual side (mhc_cost.py): the mHC kernels (the plain residual's adds for the baseline)
and the recompute kernels."""


def stage_residual_kernels(pricer: Pricer, stage: int) -> tuple[list[Kernel], list[Kernel]]:
    """(forward, backward) residual-side kernels of one micro-batch on `stage`. The forward ones are the Pricer's
    own (forward_kernels); the backward ones are what Pricer.backward_ops prices in the I chain: every sub-layer's
    residual backward, expand/contract again at a pipeline's ends, one recompute kernel per block of L_r
    sub-layers (tests/costmodel/test_explain.py checks that both price to the same time)."""
    blocks, first, last = pricer.layout[stage]
    s, spec = pricer.shape, pricer.spec
    fwd = [k for k in pricer.forward_kernels(stage) if k.group in RESIDUAL_GROUPS]
    L = 2 * len(blocks)  # an attention and an MLP sub-layer per block; their residual bytes are the same
    bwd = residual_kernels(spec, s.T, s.C, s.d, True, pricer.opt.hp_stream)[2] * L
    expand, contract = stack_ends(spec, s.T, s.C, s.d)
    bwd += (expand if first else []) + (contract if last else []) + stage_entry(spec, s.T, s.C, s.d)[1]
    L_r = pricer.stage_mem[stage].recompute_block if pricer.recompute else None
    if L_r:  # blocks of L_r sub-layers within the stage, the last one shorter (costmodel.md §2.7)
        for size in [L_r] * (L // L_r) + ([L % L_r] if L % L_r else []):
            bwd += recompute_kernels(spec, s.T, s.C, s.d, size)
    return fwd, bwd


def _stage_residual_bytes(pricer: Pricer, stage: int) -> tuple[float, float]:
    fwd, bwd = stage_residual_kernels(pricer, stage)
    return sum(k.nbytes for k in fwd), sum(k.nbytes for k in bwd)


def residual_bytes(pricer: Pricer, schedule: Schedule) -> float:
    """Residual-side HBM bytes of one step, summed over all ranks."""
    per_stage = {st: _stage_residual_bytes(pricer, st) for st in pricer.layout}
    total = 0.0
    for r in range(schedule.num_ranks):
        for a in schedule.compute_actions(r):
            if a.kind is Kind.F:
                total += per_stage[a.stage][0]
            elif a.kind in (Kind.I, Kind.B):
                total += per_stage[a.stage][1]
            elif a.kind is Kind.FB:
                total += per_stage[a.stage][0] + per_stage[a.b_stage][1]
    return total


def boundary_bytes(pricer: Pricer, sim: SimResult) -> float:
    """Stage-boundary bytes of one step (each message counted once, at its sender), summed over all ranks."""
    sends = sum(1 for s in sim.trace.spans if s.kind.startswith("SEND"))
    return sends * pricer.message_bytes


# ---- exposed all-to-all --------------------------------------------------------------------------------------
def _result_key(s: Span) -> tuple:
    if s.kind == "FB":
        return ("FB", s.stage, s.partner[0])
    return (s.kind, s.stage)


def exposed_a2a_us(pricer: Pricer, sim: SimResult) -> tuple[float, float]:
    """(exposed, total) expert all-to-all time per rank and step, mean over ranks (pricer.slowdown applied as to
    the action durations)."""
    per_rank: dict[int, list[float]] = {}
    for s in sim.trace.spans:
        if s.stream != "compute" or s.kind not in _COMPUTE:
            continue
        res = pricer.results[_result_key(s)]
        acc = per_rank.setdefault(s.rank, [0.0, 0.0])
        acc[0] += res.exposed_comm * pricer.slowdown
        acc[1] += res.comm_busy * pricer.slowdown
    if not per_rank:
        return 0.0, 0.0
    n = len(per_rank)
    return sum(v[0] for v in per_rank.values()) / n, sum(v[1] for v in per_rank.values()) / n


# ---- critical path -------------------------------------------------------------------------------------------
def critical_path_summary(sim: SimResult) -> dict:
    """traces.analysis.critical_path on the simulated trace, summed: compute on the path per action kind, communication
    on it (P2P transfers, collectives), the rest (waits' own time), and the gaps between the path's spans
    (none in a simulated trace, where every start is some input's end); the four add up to the makespan."""
    cp = critical_path(sim.trace)
    by_kind = {k: v for k, v in cp.by_kind.items() if k in _COMPUTE}
    comm = sum(v for k, v in cp.by_kind.items() if k in COMM_NODE_KINDS)
    other = sum(v for k, v in cp.by_kind.items() if k not in _COMPUTE and k not in COMM_NODE_KINDS)
    T = cp.makespan_us or 1.0
    kinds = ", ".join(f"{k} {100 * v / T:.0f}%" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]))
    text = (f"compute {100 * sum(by_kind.values()) / T:.0f}% ({kinds}), comm {100 * comm / T:.0f}%"
            + (f", other {100 * other / T:.0f}%" if other else "") + f", gaps {100 * cp.gaps_us / T:.0f}%; "
            f"{len(cp.by_rank)} ranks")
    return {"makespan_us": cp.makespan_us, "compute_us": sum(by_kind.values()), "by_kind_us": by_kind,
            "comm_us": comm, "other_us": other, "gaps_us": cp.gaps_us, "ranks": sorted(cp.by_rank), "text": text}


def anatomy(pricer: Pricer, sim: SimResult, schedule: Schedule) -> dict:
    """All of the above for one simulated variant, per rank and step (sums divided by the rank count)."""
    P = schedule.num_ranks
    exposed, total = exposed_a2a_us(pricer, sim)
    return {"residual_bytes_per_rank": residual_bytes(pricer, schedule) / P,
            "boundary_bytes_per_rank": boundary_bytes(pricer, sim) / P,
            "a2a_exposed_us": exposed, "a2a_total_us": total,
            "critical_path": critical_path_summary(sim)}
