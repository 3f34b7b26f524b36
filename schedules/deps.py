"""What each action needs and produces: the one definition of schedule semantics.

The explicit dependency graph (`graph.py`), validation and the event simulator all derive their edges from
`needs`/`produces`, so they cannot disagree about what a schedule means.

Keys (all per (stage, mb) of one chunk):
  ("F", s, m)   forward output of stage s exists on its rank
  ("G", s, m)   input-grad of stage s exists on its rank (from I, B, or the backward half of FB)
  ("I", s, m)   an input-grad-only backward ran (a W may follow)
  ("XF", s, m)  forward output of stage s has arrived on the rank of the next stage (RECV_F done)
  ("XG", s, m)  input-grad of stage s has arrived on the rank of the previous stage (RECV_B done)
P2P actions carry the *producer's* stage: SEND_F(s, m) and RECV_F(s, m) move F(s, m)'s output.
"""
from __future__ import annotations

from schedules.ir import Action, Kind, Schedule

Key = tuple[str, int, int]


class Topology:
    """Stage neighbours and placement of one schedule, precomputed for fast lookups."""

    __slots__ = ("stage_to_rank", "prev", "next")

    def __init__(self, schedule: Schedule):
        self.stage_to_rank = schedule.stage_to_rank
        self.prev = schedule.prev_stage()
        self.next = schedule.next_stage()


def needs(a: Action, rank: int, topo: Topology) -> list[Key]:
    kind = a.kind
    if kind is Kind.F:
        return _forward_needs(a.stage, a.mb, rank, topo)
    if kind is Kind.I or kind is Kind.B:
        return _backward_needs(a.stage, a.mb, rank, topo)
    if kind is Kind.W:
        return [("I", a.stage, a.mb)]
    if kind is Kind.FB:
        return _forward_needs(a.stage, a.mb, rank, topo) + _backward_needs(a.b_stage, a.b_mb, rank, topo)
    if kind is Kind.SEND_F:
        return [("F", a.stage, a.mb)]
    if kind is Kind.SEND_B:
        return [("G", a.stage, a.mb)]
    return []  # RECV_*: posting needs nothing; completion is a transfer (see graph.py / simulate.py)


def produces(a: Action) -> list[Key]:
    kind = a.kind
    if kind is Kind.F:
        return [("F", a.stage, a.mb)]
    if kind is Kind.I:
        return [("G", a.stage, a.mb), ("I", a.stage, a.mb)]
    if kind is Kind.B:
        return [("G", a.stage, a.mb)]
    if kind is Kind.FB:
        return [("F", a.stage, a.mb), ("G", a.b_stage, a.b_mb)]
    if kind is Kind.RECV_F:
        return [("XF", a.stage, a.mb)]
    if kind is Kind.RECV_B:
        return [("XG", a.stage, a.mb)]
    return []


def _forward_needs(stage: int, mb: int, rank: int, topo: Topology) -> list[Key]:
    prev = topo.prev.get(stage)
    if prev is None:
        return []
    return [("F", prev, mb) if topo.stage_to_rank[prev] == rank else ("XF", prev, mb)]


def _backward_needs(stage: int, mb: int, rank: int, topo: Topology) -> list[Key]:
    out: list[Key] = [("F", stage, mb)]
    nxt = topo.next.get(stage)
    if nxt is not None:
        out.append(("G", nxt, mb) if topo.stage_to_rank[nxt] == rank else ("XG", nxt, mb))
    return out


def first_forward_chains(schedule: Schedule) -> list[list[tuple[int, int]]]:
    """Per rank, what its first action waits for before it can start: the plain forwards F(u, m) of the stages
    upstream of it in its pipeline (nearest first), each as (stage u, u's rank), for the micro-batch m of that
    first action. Every one must run, and each hop between ranks must be sent, before the rank starts, so their
    summed durations bound when it starts (the tuner's lower bound on the step, costmodel/answers/tune.py). A chain
    stops at a forward run inside an F&B pair (it may leave before the pair's forward would end alone); a rank
    whose first action is not a plain F gets no chain."""
    topo = Topology(schedule)
    out: list[list[tuple[int, int]]] = []
    for acts in schedule.actions:
        first = next((a for a in acts if a.kind in (Kind.F, Kind.FB, Kind.B, Kind.I, Kind.W)), None)
        chain: list[tuple[int, int]] = []
        if first is not None and first.kind is Kind.F:
            u = topo.prev.get(first.stage)
            while u is not None:
                r = topo.stage_to_rank[u]
                kind = next((a.kind for a in schedule.actions[r] if a.mb == first.mb and a.stage == u
                             and a.kind in (Kind.F, Kind.FB)), None)
                if kind is not Kind.F:
                    break
                chain.append((u, r))
                u = topo.prev.get(u)
        out.append(chain)
    return out


def last_backward_chains(schedule: Schedule) -> list[list[tuple[Kind, int, int]]]:
    """Per rank, what must still run after its last action ends: when that action is a plain B or I of stage s
    and micro-batch m (it publishes the input gradient at its end), the backwards of m on the stages upstream of s
    in its pipeline (nearest first), each as (kind B or I, stage u, u's rank). Each waits for the one before it
    and for the hop between their ranks, so their summed durations bound how long the step lasts past the rank's
    last action (the tuner's lower bound on the step, costmodel/answers/tune.py). A chain stops at a backward run
    inside an F&B pair (the pair may release its input gradient before it ends), and a rank whose last action is
    a W (it publishes nothing), an F or an F&B pair gets no chain."""
    lasts = [next((a for a in reversed(acts) if a.kind in (Kind.F, Kind.FB, Kind.B, Kind.I, Kind.W)), None)
             for acts in schedule.actions]
    if not any(a is not None and a.kind in (Kind.B, Kind.I) for a in lasts):  # ZB's and DualPipe's end in W
        return [[] for _ in lasts]
    topo = Topology(schedule)
    where: dict[tuple[int, int], tuple[Kind, int]] = {}  # (stage, mb) -> its backward's kind and rank
    for r, acts in enumerate(schedule.actions):
        for a in acts:
            if a.kind is Kind.B or a.kind is Kind.I:
                where[(a.stage, a.mb)] = (a.kind, r)
            elif a.kind is Kind.FB:
                where[(a.b_stage, a.b_mb)] = (Kind.FB, r)
    out: list[list[tuple[Kind, int, int]]] = []
    for r, last in enumerate(lasts):
        chain: list[tuple[Kind, int, int]] = []
        if last is not None and last.kind in (Kind.B, Kind.I):
            u = topo.prev.get(last.stage)
            while u is not None:
                kind, ru = where.get((u, last.mb), (None, r))
                if kind is None or kind is Kind.FB or ru == r:  # the rank's own stages run before its last action
                    break
                chain.append((kind, u, ru))
                u = topo.prev.get(u)
        out.append(chain)
    return out
