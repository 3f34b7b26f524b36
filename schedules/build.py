"""`build(kind, ranks, microbatches)`: the one entry point to the generators (schedules.registry)."""
from __future__ import annotations

from schedules.ir import Schedule
from schedules.registry import kind_of


def build(kind: str, ranks: int, microbatches: int) -> Schedule:
    """Generate a compute-only schedule; raises ValueError naming the broken rule for impossible requests (or
    listing the registered kinds for an unknown one)."""
    return kind_of(kind).generator(ranks, microbatches)
