"""1F1B (PipeDream-flush): warm-up forwards, a steady one-forward-one-backward phase, cool-down backwards.

    rank r:  warm-up  F x (P-1-r)
             steady   (F, B) x (M-P+1+r)
             cooldown B x (P-1-r)
Peak live activations on rank r: P-r (at most P); bubble (P-1)(F+B).
"""
from __future__ import annotations

from schedules._checks import require, require_counts
from schedules.ir import Action, Kind, Schedule


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    require_counts("1f1b", num_ranks, num_microbatches)
    P, M = num_ranks, num_microbatches
    require(M >= P, "1f1b", f"needs microbatches >= ranks (got M={M} < P={P})",
            f"use at least {P} micro-batches")
    actions = []
    for r in range(P):
        warmup = P - 1 - r
        acts = [Action(Kind.F, r, m) for m in range(warmup)]
        for i in range(M - warmup):
            acts.append(Action(Kind.F, r, warmup + i))
            acts.append(Action(Kind.B, r, i))
        acts += [Action(Kind.B, r, m) for m in range(M - warmup, M)]
        actions.append(tuple(acts))
    return Schedule("1f1b", P, M, tuple(range(P)), (tuple(range(P)),), tuple(actions))
