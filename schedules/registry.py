"""What a schedule kind is, in one place: its generator and the facts every other package reads instead of
re-deriving them from the kind's name (the CLIs' choices, config validation, the cost model's stage counts, the
runtime's model cuts and mirrored ranks, the trace meta that traces/ reads, torch's CSV templates).

Adding a schedule: write its generator (P ranks, M micro-batches -> Schedule) and `register` it; nothing else
lists schedule names (tests/schedules/test_schedules_registry.py adds a toy one and runs it through the CLIs,
config validation and the cost model).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from schedules.dualpipe import dualpipe
from schedules.dualpipev import dualpipev
from schedules.gpipe import gpipe
from schedules.ir import Schedule
from schedules.one_f_one_b import one_f_one_b
from schedules.zb1p import zb1p


@dataclass(frozen=True)
class ScheduleKind:
    """One schedule kind's facts."""

    name: str  # the spelling every flag, config and trace uses
    generator: Callable[[int, int], Schedule]
    stages_per_rank: int = 1  # DualPipeV: 2 (a V of 2P stages); DualPipe: 1 per direction
    mirrors: bool = False  # DualPipe: ranks r and P-1-r hold copies of the same model chunks (two directions)
    csv_rounds: int = 1  # torch's CSV template of the kind holds this many micro-batches per pipeline M
    summary: str = ""

    def num_stages(self, ranks: int) -> int:
        """Stages of one pipeline of `ranks` ranks (one direction: a DualPipe direction has P)."""
        return ranks * self.stages_per_rank

    @property
    def held_per_rank(self) -> int:
        """Stages each rank holds: two for DualPipe (one per direction, mirrored) and for DualPipeV's V."""
        return 2 if self.mirrors else self.stages_per_rank

    def model_chunks(self, ranks: int) -> int:
        """How many cuts of the model: one per stage; a mirrored kind runs each chunk in both directions."""
        return self.num_stages(ranks)


_KINDS: dict[str, ScheduleKind] = {}


def register(kind: ScheduleKind) -> ScheduleKind:
    """Add a kind (its name lower-case, without '-' or '_'); a name taken already is an error."""
    key = canonical(kind.name)
    if key != kind.name:
        raise ValueError(f"schedule kind name {kind.name!r}: use the canonical spelling {key!r}")
    if key in _KINDS:
        raise ValueError(f"schedule kind {key!r} is registered already")
    _KINDS[key] = kind
    return kind


def unregister(name: str) -> None:
    """Remove a kind (tests that add a toy one take it out again)."""
    _KINDS.pop(canonical(name), None)


def canonical(name: str) -> str:
    return str(name).lower().replace("-", "").replace("_", "")


def names() -> tuple[str, ...]:
    """Every registered kind, in registration order (the order CLIs list them)."""
    return tuple(_KINDS)


def kind_of(name: str) -> ScheduleKind:
    """The kind named `name` (any case, '-' and '_' ignored); ValueError listing the kinds otherwise."""
    kind = _KINDS.get(canonical(name))
    if kind is None:
        raise ValueError(f"unknown schedule kind {name!r}; choose one of {', '.join(_KINDS)}")
    return kind


def trace_meta(name: str, ranks: int, microbatches: int) -> dict:
    """The schedule's facts as a trace carries them (traces/ reads these, it may not import schedules); a kind
    that is not registered (a schedule read from a CSV) carries its name only."""
    out = {"kind": name, "ranks": ranks, "microbatches": microbatches}
    kind = _KINDS.get(canonical(name))
    if kind is not None:
        out.update(kind=kind.name, mirrors=kind.mirrors, stages_per_rank=kind.stages_per_rank)
    return out


register(ScheduleKind("gpipe", gpipe, summary="all forwards, then all backwards"))
register(ScheduleKind("1f1b", one_f_one_b, summary="one forward, one backward in the steady state"))
register(ScheduleKind("zb1p", zb1p, summary="ZB-H1: backward split into B (input grad) and W (weight grad)"))
register(ScheduleKind("dualpipe", dualpipe, mirrors=True, csv_rounds=2,
                      summary="DeepSeek's bidirectional pipeline: two mirrored directions, overlapped F&B"))
register(ScheduleKind("dualpipev", dualpipev, stages_per_rank=2,
                      summary="DualPipe's V: one direction over 2P stages, each rank holds two"))
