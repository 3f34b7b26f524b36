"""Timing a step's dependency graph (traces.analysis.span_graph) with given durations: the replay, the longest chain
through it (the critical path) and every node's slack.

Replay, in topological order (the rule of the event engine, schedules/engine.py, on spans):
    start(v) = max over start-edges u->v of (end(u) + (lag(u,v) + [u released v] lat(v)) * g)   (an ss edge: start(u))
    end(v)   = max(start(v) + duration(v), max over end-edges u->v of end(u))
lat(v) is the recorded delay between v's start and the input that released it (the start-edge with the latest
end + lag): launch and host overheads, the OS, a stretch the trace does not explain. It stays attached to that
input, so replaying the recorded durations with g = 1 reproduces every recorded start and the makespan, and an
op released later by another input does not wait the old delay on top (Daydream's approach, Zhu et al., USENIX
ATC 2020: replay a trace's dependency graph with some task durations changed). g scales the delays
(`--scale gap=...`); a source starts lat(v) * g after the step's start t0.

The critical path is walked back from the op that ends last: at each op, to the input that bound its start (the
latest end + lag; an op whose end was held by an end-edge continues at that input). Its length is the time the
path's ops ran; makespan = length + gaps (the delays between them, before the first one and after the last).
Slack(v): how much later v could end without delaying the step, from the backward pass
    latest_end(v) = min(min over start-edges v->w of (latest_end(w) - duration(w) - lat(w) g - lag(v,w) g),
                        min over end-edges v->w of latest_end(w)),   latest_end = last end for sinks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from traces.analysis.span_graph import SpanGraph


@dataclass
class Timing:
    """A replayed step: per node (indexed like `graph.nodes`) duration, start and end, in the trace's unit."""
    graph: SpanGraph
    dur: np.ndarray
    start: np.ndarray
    end: np.ndarray
    gap_scale: float
    tail: float  # the step's end after the last node ends (e.g. a SEND span closed after its last wait)

    @property
    def makespan(self) -> float:
        return float(self.end.max() - self.graph.t0 + self.tail) if len(self.end) else 0.0


@dataclass
class Chain:
    """The critical path of a timing: node ids in time order, the time each spent on the path, the gap before
    each, and the totals."""
    nodes: list[int]
    gap_before: list[float]  # delay between the binding input's end (+ lag) and the node's start; t0 for the first
    length: float  # summed on-path times of the path's nodes
    gaps: float  # makespan - length: the delays on the path, including the tail
    tail: float
    on_path: list[float] = field(default_factory=list)  # per node: its duration, or the part of it before it
    # released the next op through a start-to-start edge (an F&B pair's output leaving mid-pair)


def _edges(g: SpanGraph):
    """Per node: its start-edges [(u, lag, from_end)] and its end-edges [u] (cached on the graph)."""
    cache = getattr(g, "_edge_cache", None)
    if cache is None:
        n = len(g.nodes)
        st_in: list[list[tuple[int, float, bool]]] = [[] for _ in range(n)]
        ff_in: list[list[int]] = [[] for _ in range(n)]
        for (u, v), (kind, lag) in g.edges.items():
            if kind == "ff":
                ff_in[v].append(u)
            else:
                st_in[v].append((u, lag, kind == "fs"))
        cache = (st_in, ff_in)
        g._edge_cache = cache  # the graph is not changed after it is built
    return cache


def measured_durations(g: SpanGraph) -> np.ndarray:
    return np.asarray([n.duration for n in g.nodes], dtype=np.float64)


def replay(g: SpanGraph, dur: np.ndarray | None = None, gap_scale: float = 1.0) -> Timing:
    d = measured_durations(g) if dur is None else np.asarray(dur, dtype=np.float64)
    st_in, ff_in = _edges(g)
    n = len(g.nodes)
    # Python floats in lists, not numpy scalars: the same IEEE sums, without numpy's cost per element (whatif
    # replays each of a long run's 10^3 steps twice)
    start = [0.0] * n
    end = [0.0] * n
    dv, t0, lat, bind = d.tolist(), g.t0, g.lat, g.bind
    unbound = float("-inf")  # a node with a binding input starts from its inputs alone
    for v in g.order:
        b = bind[v]
        s = t0 + lat[v] * gap_scale if b < 0 else unbound
        for u, lag, from_end in st_in[v]:
            t = (end[u] if from_end else start[u]) + (lag + (lat[v] if u == b else 0.0)) * gap_scale
            if t > s:
                s = t
        e = s + dv[v]
        for u in ff_in[v]:
            if end[u] > e:
                e = end[u]
        start[v], end[v] = s, e
    last = max((nd.end for nd in g.nodes), default=g.t_end)
    return Timing(g, d, np.asarray(start, dtype=np.float64), np.asarray(end, dtype=np.float64), gap_scale,
                  (g.t_end - last) * gap_scale)


def critical_chain(tm: Timing) -> Chain:
    """Walk back from the op that ends last through what bound each start (an end held by its channel's previous
    message continues there; a start bound by another op's start continues at that op's start, without its
    duration)."""
    g = tm.graph
    if not g.nodes:
        return Chain([], [], 0.0, tm.makespan, tm.tail)
    st_in, ff_in = _edges(g)
    tol = 1e-9 * max(1.0, abs(float(tm.end.max())), abs(tm.makespan))
    v = max(range(len(g.nodes)), key=lambda i: (tm.end[i], tm.start[i], i))
    at_end = True
    path: list[int] = []
    gaps: list[float] = []
    on: list[float] = []
    seen = set()
    while (v, at_end) not in seen:
        seen.add((v, at_end))
        if at_end:
            held = [u for u in ff_in[v] if tm.end[u] >= tm.end[v] - tol]
            if held and tm.end[v] > tm.start[v] + tm.dur[v] + tol:
                v = max(held, key=lambda u: (tm.end[u], u))  # its end waited for the channel's previous message
                continue
            path.append(v)
            gaps.append(0.0)
            on.append(float(tm.dur[v]))
        ins = st_in[v]
        if not ins:
            gaps[-1] += float(tm.start[v] - g.t0)
            break
        b = g.bind[v]
        u, lag, from_end = max(ins, key=lambda x: ((tm.end[x[0]] if x[2] else tm.start[x[0]])
                                                    + (x[1] + (g.lat[v] if x[0] == b else 0.0)) * tm.gap_scale,
                                                    x[0] == b, x[2], x[0]))
        if from_end:
            gaps[-1] += float(tm.start[v] - tm.end[u])
        else:  # released from inside u: the part of u before the release is on the path
            part = float(min(max(tm.start[v] - tm.start[u], 0.0), tm.dur[u]))
            gaps[-1] += float(tm.start[v] - tm.start[u]) - part
            path.append(u)
            gaps.append(0.0)
            on.append(part)
        v, at_end = u, from_end
    path.reverse()
    gaps.reverse()
    on.reverse()
    length = float(sum(on))
    return Chain(path, gaps, length, tm.makespan - length, tm.tail, on)


def slack(tm: Timing) -> np.ndarray:
    """Per node: how much later it could end without making the step longer (0 on the critical path)."""
    g = tm.graph
    n = len(g.nodes)
    st_in, ff_in = _edges(g)
    last = float(tm.end.max()) if n else 0.0
    latest = np.full(n, last)
    for w in reversed(g.order):
        ls_w = latest[w] - tm.dur[w]  # latest start of w
        for u, lag, from_end in st_in[w]:
            delay = (lag + (g.lat[w] if u == g.bind[w] else 0.0)) * tm.gap_scale
            bound = ls_w - delay + (0.0 if from_end else tm.dur[u])
            if bound < latest[u]:
                latest[u] = bound
        for u in ff_in[w]:
            if latest[w] < latest[u]:
                latest[u] = latest[w]
    return np.maximum(latest - tm.end, 0.0)
