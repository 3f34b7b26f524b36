"""GPipe: all forwards, then all backwards (full B). P ranks, one stage per rank, M micro-batches.

    rank r:  F0 F1 ... F(M-1)  |  B0 B1 ... B(M-1)
             (fill)               (drain)
Peak live activations: M on every rank; bubble (P-1)(F+B).
"""
from __future__ import annotations

from schedules._checks import require_counts
from schedules.ir import Action, Kind, Schedule


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    require_counts("gpipe", num_ranks, num_microbatches)
    P, M = num_ranks, num_microbatches
    actions = []
    for r in range(P):
        acts = [Action(Kind.F, r, m) for m in range(M)]
        acts += [Action(Kind.B, r, m) for m in range(M)]
        actions.append(tuple(acts))
    return Schedule("gpipe", P, M, tuple(range(P)), (tuple(range(P)),), tuple(actions))
