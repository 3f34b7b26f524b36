"""Stage-boundary messages of one step as transfer nodes: when a message could start (both sides posted) and when
it arrived.

A message is a RECV span (`RECV_F/s3/mb7`, on the receiver, `peer` = the sender) with the SEND span of the same
direction, stage and micro-batch on the sender whose `peer` is the receiver. posted = max(when the sender began
posting, RECV start) (a measured CPU SEND span opens when the post returned, and gloo may move the data inside
the post: the caller says when the post began).
The arrival depends on what the trace recorded (meta `p2p_completion`, traces.analysis.comm_overlap):
  * a prediction, or a run whose P2P completions are stamped: the RECV span's end;
  * a run whose P2P ops complete "at the wait" (gloo on CPU: completion is only seen from inside a wait): the RECV
    span ends when the consumer's wait returned, an upper bound of the arrival. When the wait began before the
    sender posted, the receiver was blocked on the whole transfer and the arrival is the wait's end. Otherwise the
    message may have arrived any time after it was posted; it is taken to take as long as the transfers this trace
    shows a receiver blocked on from before their post (the median of wait end - posted over those, per
    direction), never to arrive after the wait returned, and not before the message posted ahead of it on its
    channel (FIFO). `wire_us` in the result says what was used.
A RECV whose SEND is not in the trace starts at the RECV's start.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from traces.analysis.span_nodes import Node, comm_name, kind_role
from traces.names import P2P_NODE
from traces.trace import Span, Trace


@dataclass(slots=True)
class Transfer:  # a value (not frozen: a frozen dataclass builds 3x slower, and a step makes ~10^2 of these)
    node: int  # index into the node list
    src: int
    dst: int
    direction: str  # "F" (activation) or "B" (input-grad)
    stage: int
    mb: int
    send: int | None  # span index of the SEND, if in the trace
    recv: int
    send_start: float  # when the sender posted it (the RECV's start if the SEND is missing)


def at_the_wait(trace: Trace) -> bool:
    """True when the trace's P2P spans end when a wait saw them complete, not when they completed."""
    return trace.meta.get("source") not in ("predicted", "simulated") and \
        trace.meta.get("p2p_completion") == "at the wait"


def build_transfers(trace: Trace, waits: dict[tuple[int, str], list[int]], first_id: int, tol: float,
                    send_posted: Callable[[int], float], p2p: list[int] | None = None
                    ) -> tuple[list[Node], list[Transfer], dict[str, float], list[str]]:
    """(transfer nodes, their transfers, wire time used per direction in 'at the wait' traces, unmatched notes).
    `waits`: (rank, waited-for op name) -> WAIT span indices; `send_posted`: SEND span index -> when the sender
    began posting it; `p2p`: the indices of the SEND/RECV spans (kind_role "p2p"), when the caller has them."""
    spans = trace.spans
    sends: dict[tuple[str, int | None, int | None, int, int | None], list[int]] = defaultdict(list)
    recvs: list[int] = []
    if p2p is None:
        p2p = [i for i, s in enumerate(spans) if kind_role(s.kind) == "p2p"]
    for i in p2p:
        s = spans[i]
        if s.kind.startswith("SEND"):
            sends[(s.kind[-1], s.stage, s.mb, s.rank, s.peer)].append(i)
        elif s.kind.startswith("RECV") and s.stage is not None and s.mb is not None:
            recvs.append(i)
    late = at_the_wait(trace)
    rows = []
    notes: list[str] = []
    used_sends: set[int] = set()
    for j in recvs:
        r = spans[j]
        if r.peer is None:
            notes.append(f"{r.label} on rank {r.rank} names no sender (peer); left out")
            continue
        src = r.peer  # a global rank, as the runtime records it
        cands = [i for i in sends.get((r.kind[-1], r.stage, r.mb, src, r.rank), ()) if i not in used_sends]
        send = (cands[0] if len(cands) == 1 else min(cands, key=lambda i: abs(spans[i].start - r.start))
                if cands else None)
        send_start = r.start  # when the sender posted it (the RECV's start without a SEND)
        posted = r.start
        if send is not None:
            used_sends.add(send)
            send_start = send_posted(send)
            if send_start > posted:
                posted = send_start
        w = _wait_for(spans, waits.get((r.rank, comm_name(r)), ()), r.start, r.end, tol)
        rows.append((j, send, posted, w, src, send_start))
    for (d, st, mb, src, dst), idx in sends.items():
        for i in idx:
            if i not in used_sends:
                notes.append(f"{spans[i].label} on rank {src} has no RECV on rank {dst}")
    wire = _wire_times(spans, rows, tol) if late else {}
    nodes: list[Node] = []
    transfers: list[Transfer] = []
    arrivals: list[float] = []
    for j, send, posted, w, _src, _ in rows:
        r = spans[j]
        arrival = r.end
        if late and w is not None:
            ws = spans[w]
            arrival = ws.end if posted >= ws.start - tol else min(ws.end, posted + wire.get(r.kind[-1], 0.0))
        elif late:
            arrival = min(r.end, posted + wire.get(r.kind[-1], 0.0))
        elif w is not None:
            arrival = min(arrival, spans[w].end)  # the wait returned, so it had arrived
        arrival = max(arrival, posted)
        arrivals.append(arrival)
    if late:
        _fifo_arrivals(spans, rows, arrivals)
    for (j, send, posted, w, src, send_start), arrival in zip(rows, arrivals):
        r = spans[j]
        nid = first_id + len(nodes)
        label = f"P2P_{r.kind[-1]}/s{r.stage}/mb{r.mb} r{src}->r{r.rank}"
        nodes.append(Node(nid, r.rank, "comm", P2P_NODE, label, posted, arrival,
                          ((send,) if send is not None else ()) + (j,), r.stage, r.mb, ts=posted))
        transfers.append(Transfer(nid, src, r.rank, r.kind[-1], r.stage, r.mb, send, j, send_start))
    return nodes, transfers, wire, notes


def _fifo_arrivals(spans: list[Span], rows, arrivals: list[float]) -> None:
    """Estimated arrivals respect each channel's FIFO order (messages between two ranks complete in the sender's
    posting order): a message arrives no earlier than the one posted before it on its channel, and never after
    the wait that saw it complete."""
    channels: dict[tuple[int, int], list[int]] = defaultdict(list)
    for k, (j, _send, posted, _w, src, _) in enumerate(rows):
        channels[(src, spans[j].rank)].append(k)
    for ks in channels.values():
        ks.sort(key=lambda k: rows[k][2])
        prev = float("-inf")
        for k in ks:
            j, _send, _posted, w, _src, _ = rows[k]
            bound = spans[w].end if w is not None else spans[j].end
            arrivals[k] = min(max(arrivals[k], prev), max(bound, arrivals[k]))
            prev = arrivals[k]


def _wait_for(spans: list[Span], cands, posted_at: float, done_at: float, tol: float) -> int | None:
    """The wait that saw this op complete: the last one that began after the op was posted and before its span
    ended (a half of an F&B pair may wait, give the turn to the other half, and wait again)."""
    best = None
    for w in cands:
        if posted_at - tol <= spans[w].start <= done_at + tol and (best is None or spans[w].start > spans[best].start):
            best = w
    return best


def _wire_times(spans: list[Span], rows, tol: float) -> dict[str, float]:
    """Per direction, the median of (wait end - posted) over the messages whose receiver was already waiting
    when the message was posted (it was blocked on the whole transfer)."""
    seen: dict[str, list[float]] = defaultdict(list)
    for j, _send, posted, w, _src, _ in rows:
        if w is not None and posted >= spans[w].start - tol:
            seen[spans[j].kind[-1]].append(spans[w].end - posted)
    return {d: float(statistics.median(v)) for d, v in seen.items()}  # numpy's costs 30 us a call, the same value
