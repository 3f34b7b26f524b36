"""Argument checks shared by the generators; each error names the rule and the fix."""
from __future__ import annotations


def require_counts(kind: str, num_ranks: int, num_microbatches: int) -> None:
    for field_name, value in (("ranks", num_ranks), ("microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{kind}: {field_name} must be an integer, got {value!r}")
        if value < 1:
            raise ValueError(f"{kind}: {field_name} must be a positive integer, got {value}")


def require(condition: bool, kind: str, rule: str, fix: str) -> None:
    if not condition:
        raise ValueError(f"{kind}: {rule}; {fix}")
