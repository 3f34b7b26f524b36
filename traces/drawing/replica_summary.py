"""A picture of a run on hundreds of ranks: one pipeline in full, the other replicas summarised.

A data-parallel run of P pipeline ranks x D replicas (trace meta layout) drawn rank by rank needs P x D x streams
rows (768 for 16 x 16): no row is readable. Above MAX_FULL_RANKS ranks, `summarise_replicas` keeps the replica the
analyses read (traces/analysis/replicas.py: the slowest, the one its critical path runs through) in full, its
ranks numbered as pipeline ranks, and adds per pipeline rank one row of the other D - 1 replicas: each of its ops
drawn from the earliest start to the latest end of that op on any of them, so the spread between replicas and a
straggler show, and the critical path is outlined on the full pipeline. The summary rows carry no stage (they
are not schedule spans): the step's statistics and the critical path are the full pipeline's.
"""
from __future__ import annotations

from traces.analysis.replicas import layout_of, one_replica
from traces.names import is_schedule_span
from traces.trace import Span, Trace

MAX_FULL_RANKS = 32
OTHERS = "other replicas"  # the summary rows' stream


def summarise_replicas(trace: Trace) -> Trace:
    """`trace` itself when it has at most MAX_FULL_RANKS ranks or one replica; else its slowest replica in full
    plus one summary row per pipeline rank."""
    P, D = layout_of(trace)
    if D <= 1 or len(trace.ranks) <= MAX_FULL_RANKS:
        return trace
    full = one_replica(trace)
    d = full.meta["replica"]
    spread: dict[tuple, list[float]] = {}  # (pipeline rank, kind, stage, mb, partner) -> [first start, last end]
    for s in trace.spans:
        if s.rank % D == d or s.stream != "compute" or "." in s.kind or not is_schedule_span(s.kind, s.stage):
            continue
        key = (s.rank // D, s.kind, s.stage, s.mb, s.partner)
        got = spread.get(key)
        if got is None:
            spread[key] = [s.start, s.end]
        else:
            got[0] = min(got[0], s.start)
            got[1] = max(got[1], s.end)
    others = [Span(p, OTHERS, kind, None, None, a, b - a, name=f"{_name(kind, stage, mb, partner)} on the "
                   f"{D - 1} other replicas: first start to last end")
              for (p, kind, stage, mb, partner), (a, b) in sorted(spread.items(), key=lambda kv: (kv[0][0], kv[1][0]))]
    meta = {**full.meta, "summary": f"{P} x {D} ranks: replica {d} (the slowest) in full, the other {D - 1} "
                                    f"replicas as one row per pipeline rank (each op from its first start to its "
                                    "last end on any of them)"}
    return Trace(spans=full.spans + others, meta=meta)


def _name(kind: str, stage: int | None, mb: int | None, partner) -> str:
    name = f"{kind}/s{stage}/mb{mb}"
    return name + (f"+s{partner[0]}/mb{partner[1]}" if partner is not None else "")
