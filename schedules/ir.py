"""The schedule IR: actions, per-rank action lists, stage placement.

Shape letters: P ranks, M micro-batches, S stages. A `Schedule` is a plain value: it can be printed, validated,
lowered (communication inserted), simulated, priced and drawn without touching a GPU.

Stage numbering (schedules.md §1): 1F1B/ZB1P/GPipe stage s on rank s; DualPipeV stage s on rank s if s < P else
2P-1-s; DualPipe direction 0 uses stages 0..P-1 (stage b on rank b) and direction 1 stages P..2P-1 (stage P+b on
rank P-1-b). A *pipeline* is an ordered chain of stages that one micro-batch flows through; DualPipe has two
(one per direction) with M/2 micro-batches each, the others one with M. Micro-batch ids count within a pipeline,
so (stage, mb) names one chunk of work uniquely.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple

from traces import names


class Kind(str, enum.Enum):
    F = "F"  # forward of one chunk
    I = "I"  # noqa: E741  backward for inputs only (its W comes later)
    W = "W"  # backward for weights, deferred from an earlier I
    B = "B"  # full backward (I and W together)
    FB = "FB"  # overlapped forward of one chunk and backward of another, one step
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    def __str__(self) -> str:
        return self.value


COMPUTE_KINDS = frozenset({Kind.F, Kind.I, Kind.W, Kind.B, Kind.FB})
# the P2P kinds, as Kind members: the names are traces.names.COMM_KINDS (one home for what counts as P2P)
COMM_KINDS = frozenset(Kind(k) for k in names.COMM_KINDS)
BACKWARD_KINDS = frozenset({Kind.I, Kind.B})  # the ones that send an input-grad upstream


class Action(NamedTuple):
    """One step of a rank's program.

    For F, I, W, B: (stage, mb) is the chunk of work. For FB: (stage, mb) is the forward half and
    (b_stage, b_mb) the backward half (a full backward, as in DualPipe's reference). For SEND_*/RECV_*:
    (stage, mb) is the chunk whose activation (F) or input-grad (B) moves (the producer's stage on both
    sides), `peer` the other rank. A NamedTuple: schedules hold 10^5+ actions that are hashed and compared.
    """

    kind: Kind
    stage: int
    mb: int
    b_stage: int = -1
    b_mb: int = -1
    peer: int = -1

    def parts(self) -> tuple["Action", ...]:
        """Compute parts: FB -> (F, B); anything else -> (self,)."""
        if self.kind is Kind.FB:
            return (Action(Kind.F, self.stage, self.mb), Action(Kind.B, self.b_stage, self.b_mb))
        return (self,)

    def __str__(self) -> str:
        return to_name(self)


def fb(f_stage: int, f_mb: int, b_stage: int, b_mb: int) -> Action:
    return Action(Kind.FB, f_stage, f_mb, b_stage, b_mb)


def to_name(a: Action) -> str:
    """Range name of traces.md §5: `F/s3/mb7`, `FB/s3/mb7+s4/mb2`, `SEND_F/s3/mb7` (comm stream suffix is the
    recorder's business, not the IR's)."""
    base = f"{a.kind.value}/s{a.stage}/mb{a.mb}"
    if a.kind is Kind.FB:
        base += f"+s{a.b_stage}/mb{a.b_mb}"
    return base


@dataclass(frozen=True)
class Schedule:
    """A whole pipeline schedule.

    kind: generator name (gpipe, 1f1b, zb1p, dualpipe, dualpipev) or "custom".
    num_ranks, num_microbatches: P and M as requested.
    stage_to_rank: rank of every global stage.
    pipelines: ordered stage chains; each carries M / len(pipelines) micro-batches.
    actions: per-rank program, in issue order. Compute-only until `lower_comms` inserts SEND/RECV.
    """

    kind: str
    num_ranks: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    pipelines: tuple[tuple[int, ...], ...]
    actions: tuple[tuple[Action, ...], ...]
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    @property
    def microbatches_per_pipeline(self) -> int:
        return self.num_microbatches // len(self.pipelines)

    @property
    def lowered(self) -> bool:
        return any(a.kind in COMM_KINDS for acts in self.actions for a in acts)

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def next_stage(self) -> dict[int, int | None]:
        """Stage after each stage in its pipeline (None at a pipeline's end)."""
        nxt: dict[int, int | None] = {}
        for chain in self.pipelines:
            for a, b in zip(chain, chain[1:] + (None,)):
                nxt[a] = b
        return nxt

    def prev_stage(self) -> dict[int, int | None]:
        prv: dict[int, int | None] = {}
        for chain in self.pipelines:
            for a, b in zip((None,) + chain[:-1], chain):
                prv[b] = a
        return prv

    def compute_actions(self, rank: int) -> Iterator[Action]:
        return (a for a in self.actions[rank] if a.kind in COMPUTE_KINDS)

    def with_actions(self, actions: tuple[tuple[Action, ...], ...], **meta) -> "Schedule":
        return Schedule(self.kind, self.num_ranks, self.num_microbatches, self.stage_to_rank, self.pipelines,
                        actions, {**self.meta, **meta})

    def describe(self) -> str:
        """Per-rank action order, one line per rank (compute actions only unless lowered)."""
        lines = [f"{self.kind}: {self.num_ranks} ranks, {self.num_microbatches} micro-batches, "
                 f"{self.num_stages} stages"]
        for r, acts in enumerate(self.actions):
            lines.append(f"rank {r:>2}: " + " ".join(to_torch_str(a) for a in acts))
        return "\n".join(lines)


def to_torch_str(a: Action) -> str:
    """`torch.distributed.pipelining` action text: `0F0`, `2I0`, `(0F3;7B1)OVERLAP_F_B`, `3SEND_F1`."""
    if a.kind is Kind.FB:
        return f"({a.stage}F{a.mb};{a.b_stage}B{a.b_mb})OVERLAP_F_B"
    return f"{a.stage}{a.kind.value}{a.mb}"
