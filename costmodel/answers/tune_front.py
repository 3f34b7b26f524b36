"""What a layout search answers: a layout evaluated (`Evaluated`: its memory, its bound, its simulated step) and the
Pareto front of step time against memory per GPU, with the layouts tied with the best inside the model's error band
(costmodel/answers/tune.py searches; mhcpipe/tune_cli.py prints).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from costmodel.answers.tune_space import Candidate
from costmodel.pricing.data_parallel import GradSync

GIB = 2 ** 30
TIE_PCT = 2.0  # the model's +-2% error band (costmodel.md §1 anchors: 2-8% average error)


@dataclass
class Evaluated:
    cand: Candidate
    memory_bytes: float
    bound_us: float = 0.0
    pipeline_us: float | None = None  # simulated makespan of one replica
    sync: GradSync | None = None

    @property
    def step_us(self) -> float:
        return self.sync.end_us if self.sync is not None else math.inf

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB


def pareto(evals: list[Evaluated]) -> list[Evaluated]:
    """Non-dominated (step time, memory) points, fastest first; ties keep the first seen."""
    front: list[Evaluated] = []
    for e in sorted(evals, key=lambda e: (e.step_us, e.memory_bytes)):
        if not front or e.memory_bytes < front[-1].memory_bytes:
            front.append(e)
    return front


def ties_of(runnable: list[Evaluated], best: Evaluated | None, pct: float = TIE_PCT) -> list[Evaluated]:
    """The runnable Pareto front's layouts whose step is within `pct`% of the best's, least memory (most
    headroom under any budget) first; the best is one of them."""
    if best is None:
        return []
    limit = best.step_us * (1 + pct / 100)
    return sorted((e for e in pareto(runnable) if e.step_us <= limit), key=lambda e: (e.memory_bytes, e.step_us))
