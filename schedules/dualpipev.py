"""DualPipeV ("cut-in-half" DualPipe): one 2P-stage pipeline folded into a V over P ranks.

Rank r holds stages r and 2P-1-r; the bottom of the V (stages P-1 and P, both on rank P-1) is a local
hand-off without P2P. Nothing is duplicated. The per-rank order is the eight steps of `_eight_steps` with
H = P, h = r, C = M, chunk 0 = stage r, chunk 1 = stage 2P-1-r; the last rank runs its first step-4 pair
unoverlapped. Same order as torch.distributed.pipelining's ScheduleDualPipeV.
"""
from __future__ import annotations

from schedules._checks import require, require_counts
from schedules._eight_steps import eight_steps
from schedules.ir import Schedule


def v_stage_to_rank(P: int) -> tuple[int, ...]:
    return tuple(s if s < P else 2 * P - 1 - s for s in range(2 * P))


def dualpipev(num_ranks: int, num_microbatches: int) -> Schedule:
    require_counts("dualpipev", num_ranks, num_microbatches)
    P, M = num_ranks, num_microbatches
    require(M >= 2 * P, "dualpipev", f"needs microbatches >= 2 x ranks = number of stages (got M={M} < {2 * P})",
            f"use at least {2 * P} micro-batches")
    actions = tuple(
        tuple(eight_steps(P, r, M, r, 2 * P - 1 - r, first_pair_unoverlapped=(r == P - 1))) for r in range(P)
    )
    return Schedule("dualpipev", P, M, v_stage_to_rank(P), (tuple(range(2 * P)),), actions)
