"""One timed operation (`Span`), its range name (`span_name`) and the error every trace reader raises
(`TraceError`): what the simulator, the runtime's recorder and the readers make, below the `Trace` (traces.trace).

In-memory spans are plain slotted dataclasses because simulations create 10^5-10^6 of them.
"""
from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass

# Logical streams of one rank. "hp" is the high-priority compute stream (mHC post+res of MLP sub-layers).
STREAMS = ("compute", "hp", "comm")
FORMAT_NAME = "mhc-pipe-trace"


class TraceError(ValueError):
    """A trace file or trace value is malformed; the message names the field and the fix."""


def span_name(kind: str, stage: int | None, mb: int | None, partner: tuple[int, int] | None = None,
              stream: str = "compute", part: str | None = None) -> str:
    """The range name of traces.md §5, e.g. `F/s3/mb7`, `FB/s3/mb7+s4/mb2`, `SEND_F/s3/mb7~comm`; `part`: a piece
    of the op, `L12.post_res` in `F/s3/mb7/L12.post_res~hp`. The one place the runtime and the readers build
    names (traces.names.parse_name reads them back)."""
    if stage is None or mb is None:
        name = kind
    else:
        name = f"{kind}/s{stage}/mb{mb}"
        if partner is not None:
            name += f"+s{partner[0]}/mb{partner[1]}"
    if part is not None:
        name += f"/{part}"
    if stream != "compute":
        name += f"~{stream}"
    return name


@dataclass(slots=True)
class Span:
    """One timed operation on one rank's stream.

    kind: schedule op kind (F, I, W, B, FB, SEND_F, RECV_F, SEND_B, RECV_B) or another label (RC, OPT, a kernel).
    stage, mb: the (global stage, micro-batch) the op belongs to; for FB the forward half.
    partner: for FB, the (stage, mb) of the backward half.
    peer: for SEND/RECV, the other rank (global rank in measured traces).
    group, batch: for a measured communication span, the process group's name (the same on all its members, one
    per communicator) and the op's batch on that group (per rank, increasing in posting order; the ops of one
    batch_isend_irecv share it), so that `traces.analysis.comm_replay` can replay the posting order under NCCL's rules.
    Not frozen: a frozen dataclass constructs ~5x slower, and simulations create 10^5-10^6 spans; treat spans
    as values (use dataclasses.replace) all the same.
    """

    rank: int
    stream: str
    kind: str
    stage: int | None
    mb: int | None
    start: float
    duration: float
    partner: tuple[int, int] | None = None
    peer: int | None = None
    name: str = ""
    group: str | None = None
    batch: int | None = None

    @property
    def end(self) -> float:
        return self.start + self.duration

    @property
    def label(self) -> str:
        return self.name or span_name(self.kind, self.stage, self.mb, self.partner, self.stream)


SPAN_FIELDS = ("rank", "stream", "kind", "stage", "mb", "start", "duration", "partner", "peer", "name", "group",
               "batch")  # Span's fields, in order


@contextlib.contextmanager
def collector_paused():
    """Reading a trace allocates millions of objects and no cycles: without this the cyclic collector walks the
    growing heap again and again (10^6 Spans built in 2.4 s instead of 0.44 s, measured)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
