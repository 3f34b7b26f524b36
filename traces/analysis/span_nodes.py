"""The operations of one step as nodes of a dependency graph (traces.analysis.span_graph adds the edges).

* Compute nodes: the schedule ops a rank's compute thread (stream) ran - F, I, B, W, FB, RC - as the top-level
  spans of the rank's compute stream. A measured F&B pair whose halves are spans of their own
  (`F/s3/mb7`, or the stretches `F/s3/mb7/L12.block` of an overlapped pair) is only a frame: its halves are the
  nodes. Spans nested inside a node (mHC kernel parts `F/s3/mb7/L12.post_res`, a recompute `RC/s3/mb7` inside
  its backward) and the `~hp` spans of the same op are the node's *parts*: their time inside the node, by part
  name, is what `--scale mhc=...` or `--scale recompute=...` shortens (a part on the hp stream of a GPU run
  overlaps its op; only its time inside the op's interval counts).
* Transfer nodes: one per stage-boundary message (a RECV span and its SEND on the peer), from both sides posted
  to the message's arrival (traces.analysis.transfers); all-to-all and gradient all-reduce spans are comm nodes from
  their post to their completion.
* Wait nodes: a measured `WAIT/<op>` span (the compute thread blocked on that op) from the op's arrival (or the
  wait's start, whichever is later) to the wait's end: the time after the arrival is the wait's own overhead;
  the time before it is the op's, so a blocked wait puts its communication on the critical path.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from functools import lru_cache

from traces.analysis.matching import logical_stream
from traces.names import A2A_KINDS, COMM_KINDS, WAIT_KIND, parse_name
from traces.trace import Span

COMPUTE_OPS = frozenset({"F", "I", "B", "W", "FB", "RC"})
COLLECTIVE_OPS = frozenset(A2A_KINDS) | {"RG"}


@dataclass(slots=True)
class Node:
    """One operation of the step. `start`/`end` are when it ran (a wait node: from the arrival of what it waited
    for), `ts` when the rank's thread reached it (differs from `start` only for wait nodes)."""

    id: int
    rank: int
    lane: str  # "compute" (the rank's compute thread/stream) or "comm"
    kind: str  # F, I, B, W, FB, RC, P2P, A2A_DISPATCH, A2A_COMBINE, RG, WAIT
    label: str
    start: float
    end: float
    spans: tuple[int, ...]  # indices into the step trace's spans (a transfer: its SEND, then its RECV)
    stage: int | None = None
    mb: int | None = None
    partner: tuple[int, int] | None = None
    ts: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)  # part name -> time inside the node

    @property
    def duration(self) -> float:
        return self.end - self.start

    def halves(self) -> list[tuple[str, int, int]]:
        """The (half, stage, mb) of schedule work this node does: half F (forward), B (input-grad: B or I), W."""
        if self.lane != "compute" or self.stage is None or self.mb is None:
            return []
        if self.kind == "FB":
            out = [("F", self.stage, self.mb)]
            return out + ([("B", *self.partner)] if self.partner is not None else [])
        if self.kind == "F":
            return [("F", self.stage, self.mb)]
        if self.kind in ("B", "I"):
            return [("B", self.stage, self.mb)]
        if self.kind == "W":
            return [("W", self.stage, self.mb)]
        return []


_OPS: dict[str, str] = {}  # kind -> its op: a few dozen kinds, asked for ~10^6 times by a long run's graphs


def op_of(s: Span) -> str:
    kind = s.kind
    op = _OPS.get(kind)
    if op is None:
        op = _OPS[kind] = kind.split(".", 1)[0]
    return op


_ROLES: dict[str, str] = {}  # kind -> kind_role: a few dozen kinds, asked once per span of every step's graph


def kind_role(kind: str) -> str:
    """What a span of this kind is in the graph: "compute" (an op of COMPUTE_OPS or a part of one), "p2p" (a
    SEND/RECV), "collective" (an all-to-all or gradient all-reduce), "wait" or "other"."""
    role = _ROLES.get(kind)
    if role is None:
        op = kind.split(".", 1)[0]
        role = _ROLES[kind] = ("wait" if kind == WAIT_KIND else "compute" if op in COMPUTE_OPS else
                               "p2p" if op in COMM_KINDS else "collective" if op in COLLECTIVE_OPS else "other")
    return role


def part_name(s: Span) -> str:
    """`F.post_res` -> `post_res`; `RC` -> `RC`; a stretch `F.block` -> `block`."""
    return s.kind.split(".", 1)[1] if "." in s.kind else s.kind


def compute_roles(spans: list[Span], tol: float, candidates: list[int] | None = None
                  ) -> tuple[list[int], dict[int, int], list[str]]:
    """(indices of the spans that are compute nodes, part span -> the node span it is inside, notes). `candidates`:
    the indices of the spans whose kind_role is "compute", when the caller has them (else found here).

    Candidates: schedule spans (with a stage) of a compute op on a rank's compute stream. Per rank, in start
    order, a candidate inside an open one is a part of it, unless the open one is an FB frame and the candidate
    is one of its halves (op F with the pair's forward (stage, mb), op B with its backward), which makes the
    FB a frame and the half a node."""
    notes: list[str] = []
    by_rank: dict[int, list[int]] = defaultdict(list)
    hp: list[int] = []
    if candidates is None:
        candidates = [i for i, s in enumerate(spans) if kind_role(s.kind) == "compute"]
    for i in candidates:
        s = spans[i]
        if s.stage is None:
            continue
        ls = logical_stream(s)
        if ls == "compute":
            by_rank[s.rank].append(i)
        elif ls == "hp":
            hp.append(i)
    role: dict[int, str] = {}
    part_of: dict[int, int] = {}
    end = {i: spans[i].end for idx in by_rank.values() for i in idx}
    for idx in by_rank.values():
        idx.sort(key=lambda i: (spans[i].start, -spans[i].duration, i))
        stack: list[int] = []
        for i in idx:
            s = spans[i]
            while stack and end[stack[-1]] <= s.start + tol:
                stack.pop()
            parent = stack[-1] if stack and end[i] <= end[stack[-1]] + tol else None
            if parent is None:
                role[i] = "node"
            elif _is_half(spans[parent], s) and role[parent] in ("node", "frame"):
                role[parent] = "frame"
                role[i] = "node"
            else:
                owner = parent if role[parent] == "node" else part_of.get(parent)
                if owner is None:
                    notes.append(f"{s.label} on rank {s.rank} lies in a frame without being one of its halves; "
                                 "left out")
                    role[i] = "dropped"
                    continue
                role[i] = "part"
                part_of[i] = owner
            stack.append(i)
    nodes = sorted((i for i, r in role.items() if r == "node"), key=lambda i: (spans[i].start, i))
    # hp spans (mHC post+res on the high-priority stream) are parts of the node of the same op, stage and mb
    # whose interval they overlap most
    by_key: dict[tuple[int, int | None, int | None], list[int]] = defaultdict(list)
    for i in nodes:
        by_key[(spans[i].rank, spans[i].stage, spans[i].mb)].append(i)
    for i in hp:
        s = spans[i]
        best, best_ov = None, 0.0
        for j in by_key.get((s.rank, s.stage, s.mb), ()):
            ov = min(s.end, spans[j].end) - max(s.start, spans[j].start)
            if ov > best_ov:
                best, best_ov = j, ov
        if best is None:
            notes.append(f"{s.label} on rank {s.rank} overlaps no op of stage {s.stage} mb {s.mb}; left out")
        else:
            part_of[i] = best
    return nodes, part_of, notes


def _is_half(fb: Span, s: Span) -> bool:
    if fb.kind != "FB" or fb.partner is None:
        return False
    op = op_of(s)
    return (op == "F" and (s.stage, s.mb) == (fb.stage, fb.mb)) or (op in ("B", "I") and (s.stage, s.mb) == fb.partner)


def add_parts(node: Node, spans: list[Span], members: list[int]) -> None:
    """The time of each part inside the node's interval, by part name; all parts together at most the node."""
    for i in members:
        s = spans[i]
        ov = min(s.end, node.end) - max(s.start, node.start)
        if ov > 0:
            node.parts[part_name(s)] = node.parts.get(part_name(s), 0.0) + ov
    total = sum(node.parts.values())
    if total > node.duration > 0:  # parts on two streams can overlap each other: scale to the node
        node.parts = {k: v * node.duration / total for k, v in node.parts.items()}


def wait_target(s: Span) -> str | None:
    """The name of the op a WAIT span waited for (`WAIT/RECV_F/s0/mb1` -> `RECV_F/s0/mb1`)."""
    if s.kind != WAIT_KIND:
        return None
    return _waited_for(s.label)


@lru_cache(maxsize=1 << 14)
def _waited_for(label: str) -> str | None:
    """wait_target of a WAIT span's label: every step of a run waits on the same few hundred ops."""
    if not label.startswith("WAIT/"):
        return None
    return None if parse_name(label) is None else label[5:]


def comm_name(s: Span) -> str:
    label = s.label
    return label[:-5] if label.endswith("~comm") else label

