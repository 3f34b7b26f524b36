"""ZB1P = ZB-H1 (Zero Bubble, arXiv 2401.10241): 1F1B with the backward split into I (input-grad) and W
(weight-grad). I stays on the critical path; rank r holds back its first r W's so that the tail of the
pipeline, where later ranks wait for the input-grads to come back, is filled with deferred W work.

    rank r:  warm-up   F x (P-1-r)
             steady    (F, I, [W]) x (M-P+1+r)    W of the oldest pending chunk once r are pending
             cooldown  (I, [W]) x (P-1-r)          same rule
             drain     W x r
Same peak activations as 1F1B (P-r on rank r); bubble (P-1)(F+I-W) = (P-1)(F+B-2W) when F = I = W.
"""
from __future__ import annotations

from collections import deque

from schedules._checks import require, require_counts
from schedules.ir import Action, Kind, Schedule


def zb1p(num_ranks: int, num_microbatches: int) -> Schedule:
    require_counts("zb1p", num_ranks, num_microbatches)
    P, M = num_ranks, num_microbatches
    require(M >= P, "zb1p", f"needs microbatches >= ranks (got M={M} < P={P})", f"use at least {P} micro-batches")
    actions = []
    for r in range(P):
        warmup = P - 1 - r
        held_back = r
        pending: deque[int] = deque()
        acts = [Action(Kind.F, r, m) for m in range(warmup)]

        def backward_input(mb: int) -> None:
            acts.append(Action(Kind.I, r, mb))
            pending.append(mb)
            if len(pending) > held_back:
                acts.append(Action(Kind.W, r, pending.popleft()))

        for i in range(M - warmup):  # steady
            acts.append(Action(Kind.F, r, warmup + i))
            backward_input(i)
        for mb in range(M - warmup, M):  # cooldown
            backward_input(mb)
        acts.extend(Action(Kind.W, r, mb) for mb in pending)  # drain
        actions.append(tuple(acts))
    return Schedule("zb1p", P, M, tuple(range(P)), (tuple(range(P)),), tuple(actions))
