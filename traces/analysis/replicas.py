"""Data-parallel replicas of a measured run: one pipeline each.

A run of P pipeline ranks times D data-parallel replicas (trace meta["layout"] = {"pp": P, "dp": D}, the runtime's
mesh: global rank = pipeline rank x D + replica, pipeline/distributed/layout.py) holds D pipelines that run the
same schedule on their own micro-batches; stage names (F/s0/mb3) repeat in every replica. The dependency analyses
(span graph, critical path, what-if) read one pipeline: `one_replica` keeps the replica whose scheduled work spans
the longest time (the one that ends the step, the gradient all-reduce aside), its ranks renumbered to pipeline
ranks (a P2P span's peer too: its neighbour sits in the same replica) and the global ranks kept in
meta["global_ranks"].
"""
from __future__ import annotations

from dataclasses import replace

from traces.names import is_schedule_span
from traces.trace import Trace


def layout_of(trace: Trace) -> tuple[int, int]:
    """(P, D) from the trace's meta; (ranks, 1) for a trace that states no data parallelism."""
    lay = trace.meta.get("layout") or {}
    dp = lay.get("dp", 1) if isinstance(lay, dict) else 1
    pp = lay.get("pp") if isinstance(lay, dict) else None
    if not isinstance(dp, int) or dp < 1:
        dp = 1
    if not isinstance(pp, int) or pp < 1:
        pp = max(1, len(trace.ranks) // dp)
    return pp, dp


def one_replica(trace: Trace, replica: int | None = None) -> Trace:
    """The trace of one data-parallel replica (default the slowest), ranks renumbered pipeline ranks; the trace
    itself when it has one replica."""
    P, D = layout_of(trace)
    if D == 1 or len(trace.ranks) <= P:
        return trace

    def extent(d: int) -> float:
        spans = [s for s in trace.spans if s.rank % D == d and is_schedule_span(s.kind, s.stage)]
        return max((s.end for s in spans), default=0.0) - min((s.start for s in spans), default=0.0)

    d = max(range(D), key=extent) if replica is None else replica
    spans = [replace(s, rank=s.rank // D, peer=None if s.peer is None else s.peer // D)
             for s in trace.spans if s.rank % D == d]
    meta = dict(trace.meta)
    meta["layout"] = {**(trace.meta.get("layout") or {}), "dp": 1}
    meta["replica"] = d
    meta["global_ranks"] = {p: p * D + d for p in range(P)}
    return Trace(spans=spans, meta=meta)
