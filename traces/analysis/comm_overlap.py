"""Communication under compute, measured: per rank, how much of each communication op's time the compute thread
spent blocked on it (exposed) and how much ran while it computed (hidden).

Inputs are the runtime's own spans (traces.md §5): every communication op is a `~comm` span from its post to
its completion (SEND/RECV, the expert-parallel all-to-alls, the gradient all-reduces `RG`), and every time the
compute thread blocked on one there is a `WAIT/<op name>` span on the compute stream. So
    exposed(op) = time of the WAIT spans for that op,   hidden(op) = duration(op) - exposed(op),
    comm_hidden_pct = 100 * sum(hidden) / sum(duration)
over the ops of a rank (sums of op durations, so two transfers in flight at once both count). The same numbers
restricted to the ops posted inside an F&B pair (their comm span starts inside an `FB` span of the rank)
measure DualPipe's overlap: the pair's all-to-alls and sends under the other half's compute.

Only traces that record WAIT spans can say this (meta `wait_spans`: the runtime's measured traces); a predicted
or an imported trace gives None. An op's duration needs its completion time: collectives report it (their
futures); gloo P2P works report it only from inside a wait, so the runtime stamps them with waiter threads where
it needs to know (expert parallelism, meta `p2p_completion: stamped`). Otherwise (`at the wait`) a P2P span ends
when its consumer or the end-of-step drain waited for it, which would count time after its completion as hidden:
such P2P ops are left out here (`p2p_timed` False), and only their WAIT time is exposed communication.
"""
from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import numpy as np

from traces.columns import columns_of
from traces.names import ALL_COMM_KINDS, COMM_KINDS, WAIT_KIND
from traces.trace import Span, Trace


@dataclass
class CommShare:
    ops: int = 0
    comm_us: float = 0.0  # summed durations of the ops
    exposed_us: float = 0.0  # time the compute thread waited for them

    @property
    def hidden_pct(self) -> float | None:
        if self.comm_us <= 0:
            return None
        return 100.0 * max(0.0, self.comm_us - min(self.exposed_us, self.comm_us)) / self.comm_us

    def add(self, duration: float, exposed: float) -> None:
        self.ops += 1
        self.comm_us += duration
        self.exposed_us += exposed

    def to_dict(self) -> dict:
        return {**asdict(self), "hidden_pct": self.hidden_pct}


@dataclass
class RankCommOverlap:
    rank: int
    all: CommShare = field(default_factory=CommShare)
    in_fb: CommShare = field(default_factory=CommShare)  # ops posted inside an overlapped F&B pair
    by_kind: dict[str, CommShare] = field(default_factory=dict)
    blocked_us: float = 0.0  # all WAIT time of the rank: the compute thread blocked on communication
    unmatched_wait_us: float = 0.0  # WAIT time for an op with no comm span (should be 0)
    p2p_timed: bool = True  # False: the trace's P2P completion times are unknown and P2P ops are left out

    def to_dict(self) -> dict:
        return {"rank": self.rank, "blocked_us": self.blocked_us, "comm_us": self.all.comm_us,
                "exposed_us": self.all.exposed_us,
                "comm_hidden_pct": self.all.hidden_pct, "fb": self.in_fb.to_dict(),
                "by_kind": {k: v.to_dict() for k, v in sorted(self.by_kind.items())},
                "unmatched_wait_us": self.unmatched_wait_us, "p2p_timed": self.p2p_timed}


def _base(kind: str) -> str:
    return kind.split(".", 1)[0]


def _comm_name(s: Span) -> str:
    label = s.label
    return label[:-5] if label.endswith("~comm") else label


def comm_overlap(trace: Trace) -> dict[int, RankCommOverlap] | None:
    """Per rank exposed and hidden communication, or None for a trace without WAIT spans."""
    if not trace.meta.get("wait_spans"):
        return None
    p2p_timed = trace.meta.get("p2p_completion", "stamped") == "stamped"
    timed = ALL_COMM_KINDS if p2p_timed else ALL_COMM_KINDS - COMM_KINDS
    # the three kinds of span this reads, picked on the columns (10^6 spans: a pass of numpy, not of Python)
    cols = columns_of(trace)
    on_comm = np.array([s == "comm" for s in cols.streams], dtype=bool)[cols.stream]
    comm = on_comm & np.array([_base(k) in timed for k in cols.kinds], dtype=bool)[cols.kind]
    fb = np.array([k == "FB" for k in cols.kinds], dtype=bool)[cols.kind]
    wait = np.array([k == WAIT_KIND for k in cols.kinds], dtype=bool)[cols.kind]
    by_rank = np.argsort(cols.rank, kind="stable")  # each rank's spans in listing order
    ranks, first = np.unique(cols.rank[by_rank], return_index=True)
    out = {}
    for r, a, b in zip(ranks.tolist(), first.tolist(), [*first[1:].tolist(), len(by_rank)]):
        idx = by_rank[a:b]
        c = idx[comm[idx]]
        c = c[np.argsort(cols.start[c], kind="stable")]  # by post, ties in listing order
        f = idx[fb[idx]]
        f = f[np.lexsort((cols.duration[f], cols.start[f]))]
        fbs = list(zip(cols.start[f].tolist(), (cols.start[f] + cols.duration[f]).tolist()))  # Span.end's float
        out[r] = _rank_overlap(r, trace.spans_at(c), fbs, trace.spans_at(idx[wait[idx]]), p2p_timed)
    return out


def _rank_overlap(rank: int, comm: list[Span], fbs: list[tuple[float, float]], waits: list[Span],
                  p2p_timed: bool = True) -> RankCommOverlap:
    """One rank: `comm` its timed communication spans by start, `fbs` its F&B pairs' (start, end) in order, `waits`
    its WAIT spans in listing order."""
    fb_starts = [a for a, _ in fbs]
    by_name: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(comm):
        by_name[_comm_name(s)].append(i)
    # each name's instances' starts, listed once: a wait looks its op up among them (one per step), and listing
    # them per wait cost steps x waits (at 10^7 spans, minutes)
    starts = {name: [comm[i].start for i in idx] for name, idx in by_name.items()}
    exposed = [0.0] * len(comm)
    out = RankCommOverlap(rank, p2p_timed=p2p_timed)
    labels = [w.label for w in waits]
    target_of: dict[str, str | None] = {}  # a wait's label -> the op it waited for (None: not matched; few labels)
    for label in set(labels):
        target = label[5:] if label.startswith("WAIT/") else ""
        # a wait for an untimed P2P op: exposed, but not matched against a duration
        target_of[label] = None if not p2p_timed and target.split("/", 1)[0] in COMM_KINDS else target
    for w, label in zip(waits, labels):
        out.blocked_us += w.duration
        target = target_of[label]
        if target is None:
            continue
        cands = by_name.get(target, [])
        # the instance of that op (one per step) posted last before the wait began
        j = bisect_right(starts.get(target, []), w.start + 1e-6) - 1
        if j < 0:
            out.unmatched_wait_us += w.duration
            continue
        exposed[cands[j]] += w.duration
    for s, e in zip(comm, exposed):
        e = min(e, s.duration)
        out.all.add(s.duration, e)
        out.by_kind.setdefault(_base(s.kind), CommShare()).add(s.duration, e)
        k = bisect_right(fb_starts, s.start) - 1
        if k >= 0 and s.start <= fbs[k][1]:
            out.in_fb.add(s.duration, e)
    return out


def total(overlaps: dict[int, RankCommOverlap], fb: bool = False) -> CommShare:
    """All ranks together."""
    agg = CommShare()
    for o in overlaps.values():
        part = o.in_fb if fb else o.all
        agg.ops += part.ops
        agg.comm_us += part.comm_us
        agg.exposed_us += part.exposed_us
    return agg
