"""What the schedule a trace ran says: its kind, ranks and micro-batches as the metadata names them
(`schedule_descriptor`, what compare checks two traces against) and, for the critical path's graph
(traces.analysis.span_graph), which stage feeds which (the stage chains: F(s) -> F(next(s)) and B(next(s)) -> B(s)
for every micro-batch) and, given the lowered schedule itself, where each receive is posted and each channel's
message order.

traces imports nothing of schedules (tests/test_imports.py), so the chains come, in this order, from
  1. a schedule object passed by the caller (anything with `pipelines`, e.g. a `schedules.Schedule`);
  2. the trace's meta `pipelines` (schedules.simulate and the cost model write it);
  3. the trace's meta `schedule.kind` with the stage numbering of schedules.md §1 (schedules/ir.py): DualPipe
     runs two directions, stages 0..P-1 and P..2P-1; every other schedule (1F1B, ZB-H1, GPipe, DualPipeV) one
     chain 0..S-1 through all its stages (DualPipeV's chain folds back at the V's bottom on rank P-1).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

from traces.trace import Trace, TraceError


def stage_chains(trace: Trace, schedule: Any = None) -> tuple[tuple[int, ...], ...]:
    if schedule is not None:
        pipes = getattr(schedule, "pipelines", None)
        if pipes is None:
            raise TraceError("schedule: expected a schedules.Schedule (an object with `pipelines` and `actions`)")
        return tuple(tuple(int(s) for s in p) for p in pipes)
    pipes = trace.meta.get("pipelines")
    if isinstance(pipes, list) and pipes and all(isinstance(p, list) for p in pipes):
        return tuple(tuple(int(s) for s in p) for p in pipes)
    stages = sorted({s.stage for s in trace.spans if s.stage is not None})
    if not stages:
        return ()
    desc = schedule_descriptor(trace.meta)
    n = stages[-1] + 1
    mirrors = desc.get("mirrors")
    if mirrors is None:  # a trace written before schedules carried their facts (schedules.registry.trace_meta)
        mirrors = str(desc.get("kind", "")).lower() == "dualpipe"
    if mirrors:
        ranks = schedule_descriptor(trace.meta).get("ranks")
        p = int(ranks) if isinstance(ranks, int) or str(ranks).isdigit() else (n + 1) // 2
        return (tuple(range(p)), tuple(range(p, 2 * p)))
    return (tuple(range(n)),)


def neighbours(chains: tuple[tuple[int, ...], ...]) -> tuple[dict[int, int | None], dict[int, int | None]]:
    """(previous stage, next stage) of every stage in the chains (None at a chain's ends)."""
    prev: dict[int, int | None] = {}
    nxt: dict[int, int | None] = {}
    for chain in chains:
        for i, s in enumerate(chain):
            prev[s] = chain[i - 1] if i > 0 else None
            nxt[s] = chain[i + 1] if i + 1 < len(chain) else None
    return prev, nxt


def receive_posts(schedule: Any, halves: dict, nodes: list) -> dict[tuple[int, str, int, int], int | None]:
    """(receiver, direction, stage, mb) -> the node of the compute action the lowered schedule posts the RECV
    after (None: before any). `halves`: (rank, half, stage, mb) -> node ids (traces.analysis.span_graph), `nodes` the
    nodes."""
    out: dict[tuple[int, str, int, int], int | None] = {}
    for rank, acts in enumerate(getattr(schedule, "actions", ())):
        last: int | None = None
        for a in acts:
            kind = getattr(a.kind, "value", a.kind)
            if kind in ("RECV_F", "RECV_B"):
                out[(rank, kind[-1], a.stage, a.mb)] = last
            elif kind in ("F", "I", "B", "W", "FB"):
                parts = [("F", a.stage, a.mb), ("B", a.b_stage, a.b_mb)] if kind == "FB" else \
                    [({"F": "F", "W": "W"}.get(kind, "B"), a.stage, a.mb)]
                ids = [n for h in parts for n in halves.get((rank, *h), ())]
                if ids:
                    last = max(ids, key=lambda n: nodes[n].end)
    return out


def channel_order(schedule: Any) -> dict[tuple[int, int], dict[tuple[str, int, int], int]]:
    """(src, dst) -> {(direction, stage, mb): position}: each channel's messages in the sender's program order."""
    out: dict[tuple[int, int], dict[tuple[str, int, int], int]] = defaultdict(dict)
    for rank, acts in enumerate(getattr(schedule, "actions", ())):
        for a in acts:
            kind = getattr(a.kind, "value", a.kind)
            if kind in ("SEND_F", "SEND_B"):
                ch = out[(rank, a.peer)]
                ch[(kind[-1], a.stage, a.mb)] = len(ch)
    return out


def schedule_descriptor(meta: dict[str, Any]) -> dict[str, Any]:
    sched = meta.get("schedule")
    out: dict[str, Any] = {}
    if isinstance(sched, str):
        out["kind"] = sched
    elif isinstance(sched, dict):
        for name, keys in (("kind", ("kind", "name")), ("ranks", ("ranks", "num_ranks", "pp")),
                           ("microbatches", ("microbatches", "num_microbatches"))):
            v = next((sched[k] for k in keys if k in sched and isinstance(sched[k], (str, int))), None)
            if v is not None:
                out[name] = v
    for name, keys in (("ranks", ("num_ranks",)), ("microbatches", ("microbatches", "num_microbatches"))):
        if name not in out:
            v = next((meta[k] for k in keys if isinstance(meta.get(k), int)), None)
            if v is not None:
                out[name] = v
    return out
