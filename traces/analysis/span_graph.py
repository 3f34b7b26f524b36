"""The dependency graph of one step of a trace: its operations (traces.analysis.span_nodes, traces.analysis.transfers)
joined by the
schedule's dependencies, as a DAG (edges in a dict: networkx's graph object costs more than the analysis at 10^5
nodes; `nx_graph()` builds one for callers that want its algorithms). traces.analysis.replay times it,
traces.analysis.critical_path walks it.

Edges (u -> v: v cannot start before u ends, plus `lag`), the rules of schedules/deps.py and schedules/graph.py
read off span names (traces.md §5) and the stage chains (traces.analysis.stage_chains):
  * program order: on each rank's compute thread, an op follows the op that ended last before the thread reached
    it (serial on a CPU thread or one stream; overlapping halves of a GPU F&B pair get no edge between them);
  * data: F(s, m) needs F(prev(s), m) - on the same rank, else its transfer to this rank; B/I(s, m) needs
    F(s, m) and B/I(next(s), m) (same rank, else the transfer); W(s, m) needs I(s, m). A half of an F&B pair
    needs what that half needs; a pair without half spans needs both;
  * a transfer needs its tensor (the producing half on the sender, the last part of it that ended before the
    send was posted), the sender's and the receiver's posts (the thread's last op before each post; with a
    lowered schedule passed in, the receiver posts where the schedule says), and the previous message on its
    channel (FIFO). A channel's order is the sender's; where the recorded times show the next transfer starting
    before the previous one ended (several in flight), FIFO constrains their ends instead (`ff` edge);
  * a wait node needs what it waited for and the thread's previous op, with lag = the thread's time between
    that op's end and the wait's start.
An edge the recorded times contradict (u ends after v starts, beyond `tol`) is dropped and listed in
`violations`. Spans that cannot be placed (an input whose producing op is absent although its stage is in the
trace, a message nobody produced) make the graph impossible: TraceError naming them. Inputs from stages that
are not in the trace at all (one rank's file of a larger run) are outside the step and listed in `notes`.
"""
from __future__ import annotations

import bisect
import heapq
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any


from traces.analysis.receive_wait import POST_TO_COMPLETION, comm_span_meaning
from traces.analysis.replicas import one_replica
from traces.analysis.span_nodes import Node, add_parts, comm_name, compute_roles, kind_role, op_of, wait_target
from traces.analysis.stage_chains import channel_order, neighbours, receive_posts, stage_chains
from traces.analysis.step_select import step_trace
from traces.trace import Trace, TraceError
from traces.analysis.transfers import Transfer, build_transfers
from traces.names import is_schedule_span

if TYPE_CHECKING:
    import networkx as nx

MAX_LISTED = 8
_STRENGTH = {"fs": 2, "ss": 1, "ff": 0}


@dataclass
class SpanGraph:
    trace: Trace  # the step's trace; Node.spans index into trace.spans
    step: int
    nodes: list[Node]
    edges: dict[tuple[int, int], list]  # (u, v) -> [kind, lag]; kind fs: finish-to-start, ss: start-to-start,
    # ff: finish-to-finish
    t0: float  # start of the step's first schedule span
    t_end: float  # end of its last schedule span
    # per node: the recorded delay after the input that released it (its binding start-edge: the largest
    # end + lag), and that input (-1: none; the delay counts from t0)
    lat: list[float]
    bind: list[int]
    order: list[int]  # a topological order
    transfers: list[Transfer] = field(default_factory=list)
    wire_us: dict[str, float] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return self.t_end - self.t0

    def nx_graph(self) -> nx.DiGraph:
        """The graph as a networkx DiGraph (edge attributes kind and lag)."""
        return _nx(len(self.nodes), self.edges)


def _nx(n: int, edges: dict[tuple[int, int], list]) -> nx.DiGraph:
    import networkx as nx  # for callers that want its algorithms and for the cycle error: 85 ms of every start

    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    g.add_edges_from((u, v, {"kind": k, "lag": lag}) for (u, v), (k, lag) in edges.items())
    return g


def _topological(nodes: list[Node], edges: dict[tuple[int, int], list]) -> list[int] | None:
    """Kahn's order, the ready node with the smallest (start, id) first (networkx's
    lexicographical_topological_sort with that key); None if the edges make a cycle."""
    by_start = sorted(range(len(nodes)), key=lambda i: (nodes[i].start, i))
    pos = [0] * len(nodes)
    for k, i in enumerate(by_start):
        pos[i] = k
    for u, v in edges:
        if pos[u] > pos[v]:
            break
    else:  # most steps: every edge goes forward in start order, which is then Kahn's order itself (the smallest
        return by_start  # remaining node is always ready)
    succ: list[list[int]] = [[] for _ in nodes]
    indeg = [0] * len(nodes)
    for u, v in edges:
        succ[u].append(v)
        indeg[v] += 1
    heap = [(nd.start, nd.id) for nd in nodes if indeg[nd.id] == 0]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        _, u = heapq.heappop(heap)
        order.append(u)
        for v in succ[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                heapq.heappush(heap, (nodes[v].start, v))
    return order if len(order) == len(nodes) else None


def build_span_graph(trace: Trace, step: int | None = None, schedule: Any = None, info: Any = None,
                      chains: Any = None) -> SpanGraph:
    """The graph of `step` of `trace` (default: the step with the median makespan). `schedule`: optionally the
    lowered `schedules.Schedule` the trace ran, for exact receive posts and channel orders (traces never imports
    schedules; the caller passes it). `info` / `chains`: the replica's steps_of and stage_chains, when a caller
    builds the graphs of many steps (computed here otherwise: each is a pass over the whole trace)."""
    trace = one_replica(trace)  # D > 1: one pipeline, the slowest (traces/analysis/replicas.py)
    k, st = step_trace(trace, step, info)
    t0, t_end = float("inf"), float("-inf")  # the step's schedule spans' first start and last end
    for s in st.spans:
        if is_schedule_span(s.kind, s.stage):
            start = s.start
            if start < t0:
                t0 = start
            if start + s.duration > t_end:
                t_end = start + s.duration
    if t0 > t_end:
        raise TraceError(f"critical path impossible: step {k} holds no schedule op (F, B, I, W, FB with a stage)")
    tol = 1e-9 * max(1.0, abs(t_end), abs(t_end - t0))
    b = _Builder(st, tol)
    b.compute_nodes()
    b.comm_nodes()
    b.wait_nodes()
    prev, nxt = neighbours(chains if chains is not None else stage_chains(trace, schedule))
    b.program_order()
    b.data_edges(prev, nxt)
    b.transfer_edges(schedule)
    if b.unplaced:
        more = f" ... and {len(b.unplaced) - MAX_LISTED} more" if len(b.unplaced) > MAX_LISTED else ""
        raise TraceError(f"critical path impossible: {len(b.unplaced)} spans of step {k} could not be placed in the "
                         f"schedule's dependencies: {'; '.join(b.unplaced[:MAX_LISTED])}{more}; span names must follow "
                         "the schedule (traces.md §5) and every op's inputs must be in the trace")
    edges = b.edges
    order = _topological(b.nodes, edges)
    if order is None:
        import networkx as nx

        cyc = [b.nodes[u].label for u, _ in nx.find_cycle(_nx(len(b.nodes), edges))][:MAX_LISTED]
        raise TraceError(f"critical path impossible: the recorded times of step {k} make the dependencies circular "
                         f"({' -> '.join(cyc)}); the span names do not follow the schedule")
    nodes = b.nodes
    # per node its binding start-edge: the largest (end + lag, finish-to-start, u) - ties: a finish-to-start input,
    # then the later node - kept as three lists (no tuple per edge: ~10^3 edges a step, 10^3 steps a run)
    at: list[float | None] = [None] * len(nodes)
    fs_in = [False] * len(nodes)
    bind = [-1] * len(nodes)
    for (u, v), (kind, lag) in edges.items():
        if kind == "ff":
            continue
        fs = kind == "fs"
        t = (nodes[u].end if fs else nodes[u].start) + lag
        cur = at[v]
        if cur is None or t > cur or (t == cur and (fs, u) > (fs_in[v], bind[v])):
            at[v], fs_in[v], bind[v] = t, fs, u
    lat = [nd.start - (t0 if t is None else t) for nd, t in zip(nodes, at)]
    return SpanGraph(st, k, nodes, edges, t0, t_end, lat, bind, order, b.transfers, b.wire, b.violations, b.notes)


class _Builder:
    def __init__(self, trace: Trace, tol: float):
        self.trace, self.spans, self.tol = trace, trace.spans, tol
        self.nodes: list[Node] = []
        self.edges: dict[tuple[int, int], list] = {}  # (u, v) -> [kind, lag]
        self.unplaced: list[str] = []
        self.violations: list[str] = []
        self.notes: list[str] = []
        self.halves: dict[tuple[int, str, int, int], list[int]] = defaultdict(list)  # (rank, half, s, m) -> nodes
        self.transfers: list[Transfer] = []
        self.wire: dict[str, float] = {}
        self.thread: dict[int, list[int]] = defaultdict(list)  # rank -> compute-lane nodes
        # the step's spans by kind_role, and its stages and ranks, in one pass (each phase reads its own)
        self.by_role: dict[str, list[int]] = defaultdict(list)
        self.stages: set[int] = set()
        self.ranks: set[int] = set()
        for i, s in enumerate(self.spans):
            self.by_role[kind_role(s.kind)].append(i)
            self.ranks.add(s.rank)
            if s.stage is not None:
                self.stages.add(s.stage)
        # measured SEND/RECV spans start at their post; predicted ones at the transfer (traces.analysis.receive_wait)
        self.posted_spans = comm_span_meaning(trace) == POST_TO_COMPLETION
        # (rank, op name) -> (comm node, when this rank posted it)
        self.comm_by_name: dict[tuple[int, str], list[tuple[int, float]]] = defaultdict(list)

    def _add(self, node: Node) -> Node:
        self.nodes.append(node)
        return node

    def edge(self, u: int, v: int, lag: float = 0.0, kind: str = "fs", fallback: tuple[str, ...] = (),
             why: str = "") -> None:
        """Add u -> v of type `kind` (fs: v starts after u ends; ss: v starts after u starts; ff: v ends after u
        ends), or the first of `fallback` the recorded times satisfy; else record a violation."""
        if u == v:
            return
        a, b = self.nodes[u], self.nodes[v]
        if kind == "fs" and not fallback and a.end + lag - b.start <= self.tol:  # most edges: the rule below for
            d = self.edges.get((u, v))  # a satisfied finish-to-start edge, without its loop (10^6 calls at 10^6 spans)
            if d is None:
                self.edges[(u, v)] = ["fs", lag]
            elif d[0] != "fs" or lag > d[1]:
                d[0], d[1] = "fs", lag
            return
        over = 0.0
        for k in (kind, *fallback):
            over = a.end + lag - b.start if k == "fs" else a.start + lag - b.start if k == "ss" else a.end - b.end
            if over <= self.tol:
                if k == "ss":  # released from inside u: as long after u's start as recorded
                    lag = max(lag, b.start - a.start)
                break
        else:
            self.violations.append(f"{b.label} (rank {b.rank}) {'ends' if kind == 'ff' else 'starts'} {over:.3f} "
                                   f"before {a.label} (rank {a.rank}) {'starts' if kind == 'ss' else 'ends'}"
                                   f"{f' ({why})' if why else ''}")
            return
        d = self.edges.get((u, v))
        if d is None:
            self.edges[(u, v)] = [k, lag]
        elif _STRENGTH[k] > _STRENGTH[d[0]] or (k == d[0] and lag > d[1]):  # keep the stronger constraint
            d[0], d[1] = k, lag

    # ---- nodes ---------------------------------------------------------------------------------------------
    def compute_nodes(self) -> None:
        idx, part_of, notes = compute_roles(self.spans, self.tol, self.by_role["compute"])
        self.notes.extend(notes)
        members: dict[int, list[int]] = defaultdict(list)
        for p, owner in part_of.items():
            members[owner].append(p)
        nodes, spans, halves, thread = self.nodes, self.spans, self.halves, self.thread
        for i in idx:
            s = spans[i]
            start = s.start
            n = Node(len(nodes), s.rank, "compute", op_of(s), s.label, start, start + s.duration, (i,), s.stage, s.mb,
                     s.partner, ts=start)
            nodes.append(n)
            if i in members:  # most ops have no recorded kernel parts
                add_parts(n, spans, members[i])
            for half, st, mb in n.halves():
                halves[(n.rank, half, st, mb)].append(n.id)
            thread[n.rank].append(n.id)
        self._index()

    def comm_nodes(self) -> None:
        self.waits: dict[tuple[int, str], list[int]] = defaultdict(list)
        spans = self.spans
        for i in self.by_role["wait"]:
            target = wait_target(spans[i])
            if target is not None:
                self.waits[(spans[i].rank, target)].append(i)
        # all-to-alls and all-reduces of an op (with a stage): posted between ops, or inside one
        collectives = [i for i in self.by_role["collective"] if spans[i].stage is not None]
        nodes, self.transfers, self.wire, notes = build_transfers(self.trace, self.waits, len(self.nodes), self.tol,
                                                                  self._send_posted, self.by_role["p2p"])
        self.notes.extend(notes)
        for n, t in zip(nodes, self.transfers):
            self._add(n)
            self.comm_by_name[(t.dst, comm_name(self.spans[t.recv]))].append((n.id, self.spans[t.recv].start))
            if t.send is not None:
                self.comm_by_name[(t.src, comm_name(self.spans[t.send]))].append((n.id, t.send_start))
        for i in collectives:
            # all-to-alls and all-reduces posted between ops: from their post to their completion, after the op
            # before the post; one posted inside an op (an expert layer's exchange) is part of that op
            s = self.spans[i]
            if self._inside(s.rank, s.start, s.start) is None:
                n = self._add(Node(len(self.nodes), s.rank, "comm", op_of(s), s.label, s.start, s.end, (i,),
                                   s.stage, s.mb, ts=s.start))
                self.comm_by_name[(s.rank, comm_name(s))].append((n.id, s.start))
                u = self._thread_before(s.rank, s.start)
                if u is not None:
                    self.edge(u, n.id, why="posted")

    def _index(self) -> None:
        """Per rank, its compute nodes by end and by start (for _thread_before and _inside)."""
        self._by_end = {r: sorted((self.nodes[n].end, n) for n in ids) for r, ids in self.thread.items()}
        self._by_start = {r: sorted((self.nodes[n].start, n) for n in ids) for r, ids in self.thread.items()}
        self._max_len = {r: max((self.nodes[n].duration for n in ids), default=0.0) for r, ids in self.thread.items()}

    def _inside(self, rank: int, a: float, b: float) -> int | None:
        """The compute node of `rank` whose interval holds [a, b], if any."""
        by_start = self._by_start.get(rank, [])
        j = bisect.bisect_right(by_start, (a + self.tol, float("inf"))) - 1
        while j >= 0 and by_start[j][0] >= a - self._max_len[rank] - self.tol:
            nd = self.nodes[by_start[j][1]]
            if b <= nd.end + self.tol and nd.start < b + self.tol and nd.end > a:
                return nd.id
            j -= 1
        return None

    def _send_posted(self, i: int) -> float:
        """When the sender began posting SEND span i. A measured CPU span opens when the post returned (gloo may
        move the data inside the post), so it is the end of the thread's op before it, the op that produced it;
        a predicted span starts at the transfer."""
        s = self.spans[i]
        if not self.posted_spans:
            return s.start
        before = self._thread_before(s.rank, s.start)
        return self.nodes[before].end if before is not None else s.start

    def wait_nodes(self) -> None:
        tol, nodes = self.tol, self.nodes
        for (rank, target), idx in self.waits.items():
            posted = self.comm_by_name.get((rank, target), ())
            for i in idx:
                w = self.spans[i]
                w_start, w_end = w.start, w.end
                host = self._inside(rank, w_start, w_end)
                if host is not None:  # blocked inside an op (on an exchange posted inside it): part of the op
                    nodes[host].parts["wait"] = nodes[host].parts.get("wait", 0.0) + w.duration
                    continue
                # the instance of that op this rank posted last before the wait began: the largest (post time,
                # node) of those posted by then (one or two a wait: a loop, not max over a generator)
                c = last = None
                for node, t in posted:
                    if t <= w_start + tol and (last is None or (t, node) > (last, c)):
                        last, c = t, node
                if c is not None and nodes[c].end > w_end + tol:
                    # a wait that returned before the op completed: an F&B half gave the turn to the other half
                    # (or a send completed at the sender, buffered, before the receiver saw it arrive)
                    c = None
                arrival = min(self.nodes[c].end, w.end) if c is not None else w.start
                n = self._add(Node(len(self.nodes), rank, "compute", "WAIT", w.label, max(w.start, arrival), w.end,
                                   (i,), w.stage, w.mb, ts=w.start))
                self.thread[rank].append(n.id)
                if c is not None:
                    self.edge(c, n.id, why="waited for")

    # ---- edges ---------------------------------------------------------------------------------------------
    def program_order(self) -> None:
        nodes, tol, inf = self.nodes, self.tol, float("inf")
        for ids in self.thread.values():
            ids.sort(key=lambda n: (nodes[n].ts, n))
            ends: list[tuple[float, int]] = []
            for v in ids:
                nv = nodes[v]
                j = bisect.bisect_right(ends, (nv.ts + tol, inf)) - 1
                if j >= 0:
                    u = ends[j][1]
                    self.edge(u, v, lag=max(0.0, nv.ts - nodes[u].end) if nv.kind == "WAIT" else 0.0,
                              why="program order")
                bisect.insort(ends, (nv.end, v))

    def producer(self, rank: int, half: str, stage: int, mb: int, before: float | None = None) -> int | None:
        """The node that completes (rank, half, stage, mb): its last part that ended by `before`, else its last."""
        ids = self.halves.get((rank, half, stage, mb))
        if not ids:
            return None
        if len(ids) == 1:  # most ops: one node, the answer whether it ended by `before` or not
            return ids[0]
        if before is not None:
            done = [n for n in ids if self.nodes[n].end <= before + self.tol]
            if done:
                return max(done, key=lambda n: self.nodes[n].end)
        return max(ids, key=lambda n: self.nodes[n].end)

    def data_edges(self, prev: dict[int, int | None], nxt: dict[int, int | None]) -> None:
        stages = self.stages
        recv: dict[tuple[int, str, int, int], int] = {}
        for t in self.transfers:
            recv[(t.dst, t.direction, t.stage, t.mb)] = t.node
        where: dict[tuple[str, int, int], list[int]] = defaultdict(list)  # (half, stage, mb) -> ranks
        for (rank, half, st, mb) in self.halves:
            where[(half, st, mb)].append(rank)
        for (rank, half, st, mb), ids in self.halves.items():
            first = ids[0] if len(ids) == 1 else min(ids, key=lambda n: (self.nodes[n].start, n))
            begin = self.nodes[first].start
            needs: list[tuple[str, int, str]] = []  # (producing half, stage, what it is)
            if half == "F" and prev.get(st) is not None:
                needs.append(("F", prev[st], "X"))
            elif half == "B":
                needs.append(("F", st, "L"))
                if nxt.get(st) is not None:
                    needs.append(("B", nxt[st], "X"))
            elif half == "W":
                needs.append(("I", st, "L"))
            for ph, ps, how in needs:
                key = "B" if ph == "I" else ph
                u = self.producer(rank, key, ps, mb, before=begin)
                if ph == "I" and u is not None and self.nodes[u].kind != "I":
                    u = None
                if u is not None:
                    self.edge(u, first, fallback=_pair_fallback(self.nodes[u], self.nodes[first]), why="data")
                    continue
                if how == "X" and (rank, ph, ps, mb) in recv:
                    u = recv[(rank, ph, ps, mb)]
                    self.edge(u, first, fallback=_pair_fallback(self.nodes[u], self.nodes[first]), why="data")
                    continue
                others = [r for r in where.get((key, ps, mb), ()) if r != rank]
                if how == "X" and others:  # produced on another rank, transfer not recorded: a direct edge
                    u = self.producer(others[0], key, ps, mb)
                    self.edge(u, first, fallback=_pair_fallback(self.nodes[u], self.nodes[first]),
                              why="data, transfer not in the trace")
                    continue
                name = f"{'I' if ph == 'I' else key}/s{ps}/mb{mb}"
                if ps in stages:
                    self.unplaced.append(f"{self.nodes[first].label} on rank {rank} (its input {name} is not in the "
                                         "trace)")
                else:
                    self.notes.append(f"{self.nodes[first].label} on rank {rank}: input {name} from a stage outside "
                                      "the trace")

    def transfer_edges(self, schedule: Any) -> None:
        posts = receive_posts(schedule, self.halves, self.nodes) if schedule is not None else None
        channel: dict[tuple[int, int], list[Transfer]] = defaultdict(list)
        ranks = self.ranks
        for t in self.transfers:
            n = self.nodes[t.node]
            u = self.producer(t.src, "F" if t.direction == "F" else "B", t.stage, t.mb, before=t.send_start)
            if u is None:
                if t.src in ranks:
                    self.unplaced.append(f"{self.spans[t.recv].label} on rank {t.dst} (rank {t.src} never produced "
                                         f"{t.direction}/s{t.stage}/mb{t.mb})")
                else:
                    self.notes.append(f"{n.label}: sender rank {t.src} is not in the trace")
            else:
                self.edge(u, t.node, fallback=_pair_fallback(self.nodes[u], n), why="sent tensor")
            if t.send is not None and self.posted_spans:  # a measured SEND span starts at its post
                s = self._thread_before(t.src, self.spans[t.send].start)
                if s is not None:
                    self.edge(s, t.node, why="send posted")
            if self.trace.meta.get("p2p") == "dataflow":
                r = None  # a prediction whose receives count as posted from the start (schedules/engine.py)
            elif posts is not None and (t.dst, t.direction, t.stage, t.mb) in posts:
                r = posts[(t.dst, t.direction, t.stage, t.mb)]
            else:
                r = self._thread_before(t.dst, self.spans[t.recv].start)
            if r is not None:
                self.edge(r, t.node, why="receive posted")
            channel[(t.src, t.dst)].append(t)
        order = channel_order(schedule) if schedule is not None else None
        for (src, dst), ts in channel.items():
            if order is not None:
                pos = order.get((src, dst), {})
                ts.sort(key=lambda t: (pos.get((t.direction, t.stage, t.mb), 1 << 30), t.send_start))
            else:
                ts.sort(key=lambda t: (t.send_start, self.nodes[t.node].start, t.node))
            for a, b in zip(ts, ts[1:]):
                self.edge(a.node, b.node, fallback=("ff",), why="channel order")

    def _thread_before(self, rank: int, t: float) -> int | None:
        """The rank's compute op (not a wait) that ended last by `t`."""
        by_end = self._by_end.get(rank, [])
        j = bisect.bisect_right(by_end, (t + self.tol, float("inf"))) - 1
        return by_end[j][1] if j >= 0 else None


def _pair_fallback(u: Node, v: Node) -> tuple[str, ...]:
    """An F&B pair recorded as one span produces its forward's output and needs its backward's input somewhere
    inside it (the runtime runs either half first, schedules/engine.py may send from inside the pair): when the
    recorded times say so, the pair's output leaves after the pair started (ss) and the pair ends after its
    late input arrived (ff)."""
    out = ("ss",) if u.kind == "FB" else ()
    return out + (("ff",) if v.kind == "FB" else ())
