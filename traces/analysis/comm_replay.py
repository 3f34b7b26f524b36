"""Replay a measured trace's communication under NCCL's ordering rules: would this posting order deadlock or
pair the wrong tensors on NCCL, even if it happened to run on gloo (which buffers sends and matches by tag)?

What NCCL does, and so what the replay assumes:

* One communicator runs its operations in the order each rank posts them: per rank, the batches on one process
  group form a FIFO queue, and a batch starts only when the one before it on that group finished. A batch is one
  `batch_isend_irecv` (its ops share the span field `batch`) or one collective.
* A send finishes only while the matching receive runs on the peer (no buffering: NCCL is a rendezvous), and a
  collective only when every member runs it. Messages carry no tag: on one group the k-th send from a to b is
  delivered into the k-th receive at b from a (k in batch order, ties by post time, then name), and the k-th
  collectives of all members run together. So a different message or kind at the same position is a wrong
  tensor (or a hang on a size mismatch), and a different count leaves an op without partner forever.
* The host adds order too: a rank that blocked on an op (a `WAIT/<op>` span on its compute stream) posted
  nothing until that op completed. So a batch posted at time t waits for every op of its rank whose WAIT ended
  at or before t. That is the only host dependency used: it is one the run really had (a rank cannot post what
  its program reaches only after a wait), whereas guessing dependencies from data flow could invent a deadlock.

Two views, since whether P2P ops of one group share a queue depends on how the process group maps them to NCCL
communicators: `group` (one queue per (rank, group) for everything on it) and `pair` (P2P ops one queue per
(rank, group, peer), as ProcessGroupNCCL's lazily created two-rank P2P communicators give; collectives still per
(rank, group)). A batch that spans several peers becomes one unit per peer in the pair view.

The replay is a worklist fixpoint, O(n log n) in the ops: a queue is looked at again only when its head
completed or the host dependency of its head was met; an op's match (pair or collective set) completes when its
last member starts running. Whatever is still queued at the end is a deadlock, explained head by head.
"""
from __future__ import annotations

import heapq
from bisect import bisect_right
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from traces.nccl_rules import VIEWS, message_key, queue_of
from traces.trace import Trace, TraceError

__all__ = ["VIEWS", "ReplayResult", "replay"]


@dataclass(slots=True)
class _Op:
    """One communication op (a `~comm` span): role send/recv/coll; `message` is what must agree with the
    partner (P2P: the name after SEND_/RECV_, e.g. F/s0/mb3; collective: the kind)."""

    rank: int
    group: str
    batch: int
    name: str
    role: str
    peer: int | None
    start: float
    message: str
    match: int = -1  # index of its match set; -1: no complete partner set, never completes
    lacks: str = ""  # why it has no partner set
    unit: int = -1
    wpos: int = -1  # position in its rank's list of waited ops (sorted by WAIT end), -1 if never waited
    done: bool = False


@dataclass(slots=True)
class _Unit:
    """What one queue runs at a time: a batch (group view) or a batch's ops with one peer (pair view)."""

    queue: tuple
    rank: int
    ops: list[int]
    need: int = 0  # the rank's first `need` waited ops must have completed (host dependency)
    left: int = 0
    running: bool = False
    parked: bool = False


@dataclass
class ReplayResult:
    """Verdict of one view. `ok` iff no problem; `problems` lists mismatches, unmatched ops, then the deadlock
    (one line per blocked queue head and op)."""

    ok: bool
    view: str
    ops: int
    batches: int
    groups: int
    mismatches: list[str] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)
    deadlock: list[str] = field(default_factory=list)
    blocked_ranks: list[int] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        return [*self.mismatches, *self.unmatched, *self.deadlock]

    def summary(self) -> str:
        """`ok: N ops in B batches on G groups (V view)`, or e.g. `deadlock (group view): 2 ranks blocked`."""
        if self.ok:
            return f"ok: {self.ops} ops in {self.batches} batches on {self.groups} groups ({self.view} view)"
        n = len(self.blocked_ranks)
        found = [("order mismatch", f"{len(self.mismatches)} mismatched", self.mismatches),
                 ("unmatched", f"{len(self.unmatched)} unmatched", self.unmatched),
                 ("deadlock", f"{n} rank{'s' if n > 1 else ''} blocked", self.blocked_ranks)]
        kinds, details = [k for k, _, v in found if v], [d for _, d, v in found if v]
        return f"{' + '.join(kinds)} ({self.view} view): {'; '.join(details)}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "problems": self.problems, "summary": self.summary()}


def check_comm(trace: Trace, source: str = "trace") -> list[ReplayResult]:
    """Both views, group first."""
    return [replay(trace, view, source) for view in VIEWS]


def replay(trace: Trace, view: str = "group", source: str = "trace") -> ReplayResult:
    """Replay `trace`'s comm spans in `view` ("group" or "pair"). Raises TraceError (a ValueError) when the trace
    has no comm spans or comm spans without group/batch; `source` names the trace in that message."""
    if view not in VIEWS:
        raise ValueError(f"view {view!r}: use one of {', '.join(VIEWS)}")
    ops = _comm_ops(trace, source)
    mismatches, unmatched, msets = _match(ops, _members(trace, ops))
    waited = _host_waits(trace, ops)
    units, queues = _units(ops, view, waited)
    _run(ops, units, queues, msets, waited)
    deadlock, blocked = _explain(ops, units, queues, msets, waited)
    return ReplayResult(ok=not (mismatches or unmatched or deadlock), view=view, ops=len(ops),
                        batches=len({(o.rank, o.group, o.batch) for o in ops}),
                        groups=len({o.group for o in ops}), mismatches=mismatches, unmatched=unmatched,
                        deadlock=deadlock, blocked_ranks=blocked)


def _comm_ops(trace: Trace, source: str) -> list[_Op]:
    """The trace's `~comm` spans as ops, sorted by (rank, group, batch, post time, name)."""
    spans = [s for s in trace.spans if s.stream == "comm"]
    if not spans:
        raise TraceError(f"{source}: no communication spans (stream 'comm'): check-comm needs a measured trace "
                         "of mhc-pipe's runtime (mhcpipe run ... --trace-dir DIR)")
    bare = sum(getattr(s, "group", None) is None or getattr(s, "batch", None) is None for s in spans)
    if bare:
        raise TraceError(f"{source}: {bare} of {len(spans)} communication spans have no group/batch (recorded "
                         "by an older mhc-pipe): re-record the run with this version (--trace-dir DIR)")
    ops = []
    for s in spans:
        name = s.label.split("~", 1)[0]
        head = name.split("/", 1)[0]
        role = "send" if head.startswith("SEND") else "recv" if head.startswith("RECV") else "coll"
        message = s.kind if role == "coll" else message_key(name)
        ops.append(_Op(s.rank, s.group, s.batch, name, role, s.peer, s.start, message))
    ops.sort(key=lambda o: (o.rank, o.group, o.batch, o.start, o.name))
    return ops


def _members(trace: Trace, ops: list[_Op]) -> dict[str, list[int]]:
    """Members of each group: trace.meta["comm_groups"] where given, else the ranks with ops on it."""
    given = trace.meta.get("comm_groups") or {}
    seen: dict[str, set[int]] = defaultdict(set)
    for o in ops:
        seen[o.group].add(o.rank)
    return {g: sorted(r | set(given[g]) if g in given else r) for g, r in seen.items()}


def _match(ops: list[_Op], members: dict[str, list[int]]) -> tuple[list[str], list[str], list[list[int]]]:
    """Pair the k-th send a->b with the k-th receive at b from a on each group, and the k-th collectives of a
    group's members; return (mismatch lines, unmatched lines, match sets). Ops are in batch order per rank."""
    p2p: dict[tuple, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    colls: dict[tuple[str, int], list[int]] = defaultdict(list)
    mismatches: list[str] = []
    unmatched: list[str] = []
    msets: list[list[int]] = []
    for i, o in enumerate(ops):
        if o.role == "coll":
            colls[(o.group, o.rank)].append(i)
        elif o.peer is None:
            o.lacks = "no peer recorded"
            unmatched.append(f"unmatched on {o.group}: rank {o.rank}'s {o.name} has no peer rank recorded")
        elif o.role == "send":
            p2p[(o.group, o.rank, o.peer)][0].append(i)
        else:
            p2p[(o.group, o.peer, o.rank)][1].append(i)
    for key in sorted(p2p):
        _match_channel(ops, key, *p2p[key], mismatches, unmatched, msets)
    for g in sorted({g for g, _ in colls}):
        _match_collectives(ops, g, {m: colls.get((g, m), []) for m in members[g]}, mismatches, unmatched, msets)
    return mismatches, unmatched, msets


def _match_channel(ops: list[_Op], key: tuple[str, int, int], ss: list[int], rs: list[int], mismatches: list[str],
                   unmatched: list[str], msets: list[list[int]]) -> None:
    """Sends `ss` from a to b on group g against receives `rs` at b from a, position by position."""
    g, a, b = key
    for k in range(max(len(ss), len(rs))):
        if k < len(ss) and k < len(rs):
            s, r = ops[ss[k]], ops[rs[k]]
            if s.message != r.message:
                mismatches.append(f"order mismatch on {g}: send #{k + 1} from rank {a} to rank {b} is "
                                  f"{s.message} but receive #{k + 1} at rank {b} from rank {a} is {r.message}")
            s.match = r.match = len(msets)
            msets.append([ss[k], rs[k]])
        elif k < len(ss):
            o = ops[ss[k]]
            o.lacks = f"a receive at rank {b} that is never posted"
            unmatched.append(f"unmatched on {g}: rank {a}'s {o.name} (send #{k + 1} to rank {b}) has no receive "
                             f"(rank {b} posts {len(rs)} from rank {a})")
        else:
            o = ops[rs[k]]
            o.lacks = f"a send from rank {a} that is never posted"
            unmatched.append(f"unmatched on {g}: rank {b}'s {o.name} (receive #{k + 1} from rank {a}) has no "
                             f"send (rank {a} posts {len(ss)} to rank {b})")


def _match_collectives(ops: list[_Op], g: str, lists: dict[int, list[int]], mismatches: list[str],
                       unmatched: list[str], msets: list[list[int]]) -> None:
    """The k-th collectives of the members of group g (`lists`: member -> its collectives in order)."""
    for k in range(max(len(v) for v in lists.values())):
        have = {m: ops[v[k]] for m, v in lists.items() if k < len(v)}
        if len({o.message for o in have.values()}) > 1:
            mismatches.append(f"order mismatch on {g}: collective #{k + 1} is " + ", ".join(
                f"{o.message} on rank {m} ({o.name})" for m, o in have.items()))
        missing = [m for m in lists if m not in have]
        if missing:
            for o in have.values():
                o.lacks = f"collective #{k + 1} on {g}, which rank(s) {_ranks(missing)} never post"
            names = ", ".join(sorted({o.name for o in have.values()}))
            unmatched.append(f"unmatched on {g}: collective #{k + 1} ({names}) is posted by rank(s) "
                             f"{_ranks(list(have))} but not by {_ranks(missing)}")
            continue
        for o in have.values():
            o.match = len(msets)
        msets.append([v[k] for v in lists.values()])


def _host_waits(trace: Trace, ops: list[_Op]) -> dict[int, list[tuple[float, int]]]:
    """Per rank, the ops its host waited for, as (WAIT end, op index) sorted; sets each op's `wpos`. A WAIT
    names the op; the instance is the rank's last op of that name posted before the WAIT ended. None for a run
    whose overlapped F&B pairs post from two threads (meta layout: overlap with EP): a WAIT there blocks one
    half only, so it orders nothing the other half posts, and using it would invent a deadlock."""
    lay = trace.meta.get("layout") or {}
    if lay.get("overlap") and (lay.get("ep") or 1) > 1:
        return {}
    by_name: dict[tuple[int, str], list[tuple[float, int]]] = defaultdict(list)
    for i, o in enumerate(ops):
        by_name[(o.rank, o.name)].append((o.start, i))
    for v in by_name.values():
        v.sort()
    end: dict[int, float] = {}
    for s in trace.spans:
        if s.stream == "comm" or not s.label.startswith("WAIT/"):
            continue
        cands = by_name.get((s.rank, s.label[5:].split("~", 1)[0]))
        k = bisect_right(cands, (s.end, len(ops))) if cands else 0
        if k:
            i = cands[k - 1][1]
            end[i] = min(end.get(i, s.end), s.end)
    waited: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for i, e in end.items():
        waited[ops[i].rank].append((max(e, ops[i].start), i))
    for lst in waited.values():
        lst.sort()
        for p, (_, i) in enumerate(lst):
            ops[i].wpos = p
    return waited


def _units(ops: list[_Op], view: str, waited: dict[int, list[tuple[float, int]]]
           ) -> tuple[list[_Unit], dict[tuple, list[int]]]:
    """Cut the ops into units and queue them (ops are sorted by rank, group, batch, start). A batch posted at t
    needs the rank's waited ops with WAIT end <= t, except those of its own batch."""
    ends = {r: [e for e, _ in lst] for r, lst in waited.items()}
    units: list[_Unit] = []
    queues: dict[tuple, list[int]] = defaultdict(list)
    i = 0
    while i < len(ops):
        o, j = ops[i], i + 1
        while j < len(ops) and (ops[j].batch, ops[j].group, ops[j].rank) == (o.batch, o.group, o.rank):
            j += 1
        need = bisect_right(ends.get(o.rank, ()), o.start)  # o is the batch's first post
        need = min([need, *(ops[k].wpos for k in range(i, j) if ops[k].wpos >= 0)])
        parts: dict[tuple, list[int]] = defaultdict(list)
        for k in range(i, j):
            peer = ops[k].peer if ops[k].role != "coll" else None
            qname = queue_of(view, o.group, peer)  # the communicator the op runs on in this view
            parts[(o.rank, o.group, None if qname == o.group else peer)].append(k)
        for q, members in parts.items():
            for k in members:
                ops[k].unit = len(units)
            queues[q].append(len(units))
            units.append(_Unit(q, o.rank, members, need=need, left=len(members)))
        i = j
    return units, queues


def _run(ops: list[_Op], units: list[_Unit], queues: dict[tuple, list[int]], msets: list[list[int]],
         waited: dict[int, list[tuple[float, int]]]) -> None:
    """Run every queue as far as NCCL's rules allow (worklist until nothing changes)."""
    head = {q: 0 for q in queues}
    prefix = {r: 0 for r in waited}  # per rank: how many of its waited ops (in WAIT-end order) have completed
    parked: dict[int, list[tuple[int, int]]] = defaultdict(list)  # rank -> heap of (need, unit) host-blocked
    running = [0] * len(msets)
    work = list(queues)

    def complete(i: int) -> None:
        o = ops[i]
        o.done = True
        u = units[o.unit]
        u.left -= 1
        if u.left == 0:
            head[u.queue] += 1
            work.append(u.queue)
        if o.wpos >= 0:
            lst, p = waited[o.rank], prefix[o.rank]
            while p < len(lst) and ops[lst[p][1]].done:
                p += 1
            prefix[o.rank] = p
            heap = parked[o.rank]
            while heap and heap[0][0] <= p:
                work.append(units[heapq.heappop(heap)[1]].queue)

    while work:
        q = work.pop()
        if head[q] >= len(queues[q]):
            continue
        uid = queues[q][head[q]]
        u = units[uid]
        if u.running:
            continue
        if u.need > prefix.get(u.rank, 0):
            if not u.parked:
                u.parked = True
                heapq.heappush(parked[u.rank], (u.need, uid))
            continue
        u.running = True
        for i in u.ops:
            m = ops[i].match
            if m < 0:
                continue
            running[m] += 1
            if running[m] == len(msets[m]):
                for j in msets[m]:
                    complete(j)


def _explain(ops: list[_Op], units: list[_Unit], queues: dict[tuple, list[int]], msets: list[list[int]],
             waited: dict[int, list[tuple[float, int]]]) -> tuple[list[str], list[int]]:
    """One line per op of each blocked queue head: what it waits for and why that does not run."""
    lines, blocked = [], set()
    first = {q: next((units[u] for u in us if units[u].left), None) for q, us in queues.items()}
    for q in sorted(queues, key=lambda q: (q[0], q[1], -1 if q[2] is None else q[2])):
        u = first[q]
        if u is None:
            continue
        blocked.add(u.rank)
        where = f"rank {u.rank} [{q[1]}{'' if q[2] is None else f', peer {q[2]}'}]"
        if not u.running:
            lines.append(f"{where} {_names(ops, u)} waits for its host: {_host_block(ops, u, waited)}")
            continue
        for i in u.ops:
            o = ops[i]
            if o.done:
                continue
            if o.match < 0:
                lines.append(f"{where} {o.name} waits for {o.lacks}")
                continue
            why = [f"rank {ops[j].rank}'s {ops[j].name}{_held(ops, first, waited, units[ops[j].unit])}"
                   for j in msets[o.match] if not units[ops[j].unit].running]
            more = f" and {len(why) - 3} more" if len(why) > 3 else ""
            lines.append(f"{where} {o.name} waits for {'; '.join(why[:3])}{more}")
    return lines, sorted(blocked)


def _held(ops: list[_Op], first: dict[tuple, _Unit | None], waited: dict[int, list[tuple[float, int]]],
          v: _Unit) -> str:
    """Why unit `v` (not running) does not run: queued behind its queue's head, or its host is blocked."""
    if first[v.queue] is not v:
        return f", queued behind {_names(ops, first[v.queue])}"
    return f", held by its host ({_host_block(ops, v, waited)})"


def _host_block(ops: list[_Op], u: _Unit, waited: dict[int, list[tuple[float, int]]]) -> str:
    pending = next(i for _, i in waited[u.rank][:u.need] if not ops[i].done)
    return f"posted after WAIT/{ops[pending].name}, which has not completed"


def _names(ops: list[_Op], u: _Unit) -> str:
    names = [ops[i].name for i in u.ops]
    return "+".join(names[:3]) + (f"+{len(names) - 3} more" if len(names) > 3 else "")


def _ranks(ranks: list[int]) -> str:
    return ",".join(str(r) for r in sorted(ranks))
