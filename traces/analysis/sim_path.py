"""The critical path of a simulated step (schedules.simulate's trace, the cost model's prediction) without building
its whole dependency graph: `mhcpipe predict` needs the path's time per op kind for two simulations, and the
general graph (traces.analysis.span_graph) costs ~0.1 s each on DeepSeek-V3's 10^4 spans.

A simulated step has exactly one span per schedule op (F, I, W, B, FB on a rank's compute stream; one SEND and one
RECV per stage-boundary message) and no gaps, so the graph's rules (span_graph's docstring) can be applied to the
ops on the path alone: walking back from the op that ends last, each op's inputs (program order, the schedule's
data edges, a transfer's producer, receive post and channel predecessor) are looked up by key, typed as the graph
types them (finish-to-start; start-to-start when a pair released its output before it ended; finish-to-finish,
not a start input, when a pair's late input arrived after it began) and the binding one taken with the graph's tie
rules (latest time, then finish-to-start, then the larger node id: compute nodes in (start, span) order, transfers
after them in RECV order). The result equals traces.analysis.critical_path's on the same trace
(tests/traces/test_sim_path.py compares them over schedules, P2P modes, unit costs full of ties and the presets).

`simulated_path` returns None for a trace it does not cover (measured, several steps, kernel parts, collectives,
waits): the caller then uses critical_path.
"""
from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass

from traces.names import COMM_NODE_KINDS, P2P_NODE
from traces.analysis.stage_chains import neighbours, stage_chains
from traces.trace import Trace

_COMPUTE = frozenset({"F", "I", "W", "B", "FB"})
_RECV = {"RECV_F": "F", "RECV_B": "B"}
_SEND = {"SEND_F": "F", "SEND_B": "B"}
_STRENGTH = {"fs": 2, "ss": 1, "ff": 0}  # two edges between the same ops keep the stronger (span_graph's rule)


@dataclass
class PathTotals:
    """What the critical path puts where: time per node kind (F, I, W, B, FB, P2P) in path order's sums, the
    transfers on it, its length and its ops (labels, in time order)."""
    by_kind: dict[str, float]
    exposed_comm_us: float
    length_us: float
    labels: list[str]


def simulated_path(trace: Trace) -> PathTotals | None:
    """The critical path of a one-step simulated trace (module docstring), or None when the trace is not one."""
    g = _Step.of(trace)
    return None if g is None else g.walk()


class _Step:
    """The ops of the step: compute nodes (ids 0.. in (start, span) order) and transfers (ids after them)."""

    def __init__(self, trace: Trace, compute: list[int], recvs: list[tuple[int, int]], tol: float):
        spans = self.spans = trace.spans
        self.tol = tol
        self.dataflow = trace.meta.get("p2p") == "dataflow"
        self.prev_stage, self.next_stage = neighbours(stage_chains(trace))
        n_c = len(compute)
        # node v: kind, rank, start, end and the span(s) it came from (labels only for the path's nodes);
        # compute nodes first
        cs = [spans[i] for i in compute]
        self.kind: list[str] = [s.kind for s in cs]
        self.rank: list[int] = [s.rank for s in cs]
        self.start: list[float] = [s.start for s in cs]
        self.end: list[float] = [s.start + s.duration for s in cs]
        self.origin: list = list(cs)  # the compute span, or a transfer's (RECV span, SEND span)
        self.half: dict[tuple[int, str, int, int], int] = {}
        self.halves: list[list[tuple[str, int, int]]] = []
        half, halves = self.half, self.halves
        by_rank: dict[int, list[int]] = defaultdict(list)
        for v, s in enumerate(cs):
            hv = _halves(s.kind, s.stage, s.mb, s.partner)
            halves.append(hv)
            r = s.rank
            for h, st, mb in hv:
                half[(r, h, st, mb)] = v
            by_rank[r].append(v)
        # program order: the op that ended last before the rank's thread reached this one (span_graph's rule)
        program: list[int | None] = [None] * n_c
        self.program = program
        self.by_end: dict[int, list[tuple[float, int]]] = {}
        start, end, inf = self.start, self.end, float("inf")
        bisect_right, insort = bisect.bisect_right, bisect.insort
        for r, ids in by_rank.items():
            ends: list[tuple[float, int]] = []
            for v in ids:  # ids are in (start, id) order already
                j = bisect_right(ends, (start[v] + tol, inf)) - 1
                program[v] = ends[j][1] if j >= 0 else None
                insort(ends, (end[v], v))
            self.by_end[r] = ends
        # transfers, in RECV order: (src, dst, direction, stage, mb)
        self.transfer: list[tuple[int, int, str, int, int]] = []
        self.recv: dict[tuple[int, str, int, int], int] = {}
        channel: dict[tuple[int, int], list[int]] = defaultdict(list)
        posted: dict[int, float] = {}  # when the sender posted it: its SEND span's start
        v = len(self.kind)
        for j, send in recvs:
            r, sd = spans[j], spans[send]
            rank, peer, d, st, mb = r.rank, r.peer, r.kind[-1], r.stage, r.mb
            self.kind.append(P2P_NODE)
            self.rank.append(rank)
            self.start.append(r.start if r.start > sd.start else sd.start)
            self.end.append(r.start + r.duration)
            self.origin.append((r, sd))
            self.transfer.append((peer, rank, d, st, mb))
            self.recv[(rank, d, st, mb)] = v
            channel[(peer, rank)].append(v)
            posted[v] = sd.start
            v += 1
        self.channel_prev: dict[int, int] = {}
        for ids in channel.values():  # the sender's posting order (no schedule given: by time, then id)
            ids.sort(key=lambda v: (posted[v], self.start[v], v))
            for a, b in zip(ids, ids[1:]):
                self.channel_prev[b] = a
        self.n_compute = n_c

    def label(self, v: int) -> str:
        o = self.origin[v]
        if v < self.n_compute:
            return o.label
        r = o[0]
        return f"P2P_{r.kind[-1]}/s{r.stage}/mb{r.mb} r{r.peer}->r{r.rank}"

    @classmethod
    def of(cls, trace: Trace) -> _Step | None:
        if trace.meta.get("source") not in ("simulated", "predicted") or trace.meta.get("steps", 1) != 1:
            return None
        spans = trace.spans
        compute: list[int] = []
        recvs: list[int] = []
        sends: dict[tuple[str, int, int, int, int], int] = {}
        seen: set[tuple] = set()
        for i, s in enumerate(spans):
            kind, stage, mb = s.kind, s.stage, s.mb
            if stage is None or mb is None:
                return None
            stream = s.stream
            if stream == "compute" and kind in _COMPUTE:
                key = (s.rank, kind, stage, mb)
                if key in seen or (kind == "FB" and s.partner is None):
                    return None
                seen.add(key)
                compute.append(i)
            elif stream == "comm" and kind in _RECV and s.peer is not None:
                recvs.append(i)
            elif stream == "comm" and kind in _SEND and s.peer is not None:
                key = (_SEND[kind], stage, mb, s.rank, s.peer)
                if key in sends:
                    return None
                sends[key] = i
            else:
                return None  # kernel parts, collectives, waits, steps: the general graph's cases
        if not compute:
            return None
        pairs = []
        for j in recvs:
            r = spans[j]
            send = sends.pop((_RECV[r.kind], r.stage, r.mb, r.peer, r.rank), None)
            if send is None:
                return None
            pairs.append((j, send))
        if sends:
            return None
        t0 = min(s.start for s in spans)
        t_end = max(s.end for s in spans)
        compute.sort(key=lambda i: (spans[i].start, i))
        return cls(trace, compute, pairs, 1e-9 * max(1.0, abs(t_end), abs(t_end - t0)))

    # ---- the inputs of one node, typed as span_graph types them ----------------------------------------------
    def _edge(self, out: dict[int, list], u: int | None, v: int, fallback: tuple[str, ...] = ()) -> None:
        if u is None or u == v:
            return
        for k in ("fs", *fallback):
            over = (self.end[u] - self.start[v] if k == "fs" else self.start[u] - self.start[v] if k == "ss"
                    else self.end[u] - self.end[v])
            if over <= self.tol:
                break
        else:
            return  # the recorded times contradict it: the graph drops it too
        lag = max(0.0, self.start[v] - self.start[u]) if k == "ss" else 0.0
        d = out.get(u)
        if d is None:
            out[u] = [k, lag]
        elif _STRENGTH[k] > _STRENGTH[d[0]] or (k == d[0] and lag > d[1]):
            d[0], d[1] = k, lag

    def _fallback(self, u: int, v: int) -> tuple[str, ...]:
        return (("ss",) if self.kind[u] == "FB" else ()) + (("ff",) if self.kind[v] == "FB" else ())

    def _inputs(self, v: int) -> dict[int, list]:
        out: dict[int, list] = {}
        if v < self.n_compute:
            self._edge(out, self.program[v], v)
            r = self.rank[v]
            for half, st, mb in self.halves[v]:
                needs = []
                if half == "F" and self.prev_stage.get(st) is not None:
                    needs.append(("F", self.prev_stage[st], True))
                elif half == "B":
                    needs.append(("F", st, False))
                    if self.next_stage.get(st) is not None:
                        needs.append(("B", self.next_stage[st], True))
                elif half == "W":
                    needs.append(("I", st, False))
                for ph, ps, remote in needs:
                    u = self.half.get((r, "B" if ph == "I" else ph, ps, mb))
                    if ph == "I" and u is not None and self.kind[u] != "I":
                        u = None
                    if u is None and remote:
                        u = self.recv.get((r, ph, ps, mb))
                    if u is None:
                        raise _NotCovered
                    self._edge(out, u, v, self._fallback(u, v))
            return out
        src, dst, direction, st, mb = self.transfer[v - self.n_compute]
        u = self.half.get((src, direction, st, mb))
        if u is None:
            raise _NotCovered
        self._edge(out, u, v, self._fallback(u, v))
        if not self.dataflow:  # the receiver's op that ended last by the transfer (span_graph._thread_before)
            ends = self.by_end.get(dst, [])
            j = bisect.bisect_right(ends, (self.start[v] + self.tol, float("inf"))) - 1
            self._edge(out, ends[j][1] if j >= 0 else None, v)
        self._edge(out, self.channel_prev.get(v), v, ("ff",))
        return out

    def walk(self) -> PathTotals | None:
        """replay.critical_chain on the recorded times (which a simulated step's replay reproduces)."""
        n = len(self.kind)
        v = max(range(n), key=lambda i: (self.end[i], self.start[i], i))
        at_end = True
        path: list[tuple[int, float]] = []
        seen = set()
        try:
            while (v, at_end) not in seen:
                seen.add((v, at_end))
                if at_end:
                    path.append((v, self.end[v] - self.start[v]))
                starts = [(u, k, lag) for u, (k, lag) in self._inputs(v).items() if k != "ff"]
                if not starts:
                    break
                u, k, _ = max(starts, key=lambda e: ((self.end[e[0]] if e[1] == "fs" else self.start[e[0]]) + e[2],
                                                     e[1] == "fs", e[0]))
                if k == "ss":  # released from inside u: the part of u before the release is on the path
                    path.append((u, min(max(self.start[v] - self.start[u], 0.0), self.end[u] - self.start[u])))
                v, at_end = u, k == "fs"
        except _NotCovered:
            return None
        path.reverse()
        by_kind: dict[str, float] = defaultdict(float)
        for u, d in path:
            by_kind[self.kind[u]] += d
        return PathTotals(dict(by_kind), sum(t for k, t in by_kind.items() if k in COMM_NODE_KINDS),
                          float(sum(d for _, d in path)), [self.label(u) for u, _ in path])


class _NotCovered(Exception):
    """An input the simulated step should hold is missing: leave the trace to the general graph."""


def _halves(kind: str, stage: int, mb: int, partner: tuple[int, int] | None) -> list[tuple[str, int, int]]:
    if kind == "FB":
        return [("F", stage, mb), ("B", *partner)]
    return [("B" if kind == "I" else kind, stage, mb)]
