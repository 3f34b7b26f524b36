"""DualPipe (DeepSeek-V3): two pipelines in opposite directions over the same P ranks (P even).

Rank r holds layer-block r of direction 0 (stage r) and layer-block P-1-r of direction 1 (stage 2P-1-r), so
every block lives on two ranks and parameters are duplicated. Each direction carries M/2 micro-batches. The
per-rank order is the eight steps of `_eight_steps` with H = P/2, h = min(r, P-1-r), C = M/2; chunk 0 is the
direction whose source is nearer (direction 0 on the first half of the ranks, direction 1 on the second).
The two middle ranks run their first step-4 pair unoverlapped, as the reference does.
"""
from __future__ import annotations

from schedules._checks import require, require_counts
from schedules._eight_steps import eight_steps
from schedules.ir import Schedule


def dualpipe_stage_to_rank(P: int) -> tuple[int, ...]:
    return tuple(range(P)) + tuple(P - 1 - b for b in range(P))


def dualpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    require_counts("dualpipe", num_ranks, num_microbatches)
    P, M = num_ranks, num_microbatches
    require(P % 2 == 0, "dualpipe", f"needs an even number of ranks (got P={P})",
            "use an even number of pipeline ranks, or dualpipev for any P")
    require(M % 2 == 0, "dualpipe", f"needs an even number of micro-batches, half per direction (got M={M})",
            f"use M={M + 1}")
    require(M >= 2 * P, "dualpipe", f"needs microbatches >= 2 x ranks (got M={M} < 2P={2 * P})",
            f"use at least {2 * P} micro-batches")
    H, C = P // 2, M // 2
    actions = []
    for r in range(P):
        h = min(r, P - 1 - r)
        direction0, direction1 = r, 2 * P - 1 - r
        stage0, stage1 = (direction0, direction1) if r < H else (direction1, direction0)
        middle = r in (H - 1, H)
        actions.append(tuple(eight_steps(H, h, C, stage0, stage1, first_pair_unoverlapped=middle)))
    pipelines = (tuple(range(P)), tuple(range(P, 2 * P)))
    return Schedule("dualpipe", P, M, dualpipe_stage_to_rank(P), pipelines, tuple(actions))
