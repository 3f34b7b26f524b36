"""`build(kind, ranks, microbatches)`: the one entry point to the generators."""
from __future__ import annotations

from typing import Callable

from schedules.dualpipe import dualpipe
from schedules.dualpipev import dualpipev
from schedules.gpipe import gpipe
from schedules.ir import Schedule
from schedules.one_f_one_b import one_f_one_b
from schedules.zb1p import zb1p

GENERATORS: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "zb1p": zb1p,
    "dualpipe": dualpipe,
    "dualpipev": dualpipev,
}


def build(kind: str, ranks: int, microbatches: int) -> Schedule:
    """Generate a compute-only schedule; raises ValueError naming the broken rule for impossible requests."""
    key = kind.lower().replace("-", "").replace("_", "")
    if key not in GENERATORS:
        raise ValueError(f"unknown schedule kind {kind!r}; choose one of {', '.join(GENERATORS)}")
    return GENERATORS[key](ranks, microbatches)
