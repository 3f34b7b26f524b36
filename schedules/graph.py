"""The schedule as an explicit networkx dependency graph (nodes = (rank, position) of every action).

Edges, from `deps.needs`/`deps.produces` and the runtime's rules:
  * program order of compute actions on a rank (one compute stream);
  * a SEND/RECV is posted after the compute action before it in the rank's list, and a SEND (whose
    tensor must exist) is posted before the compute action after it;
  * data: producer of a needed key -> consumer (RECV nodes produce the XF/XG keys, i.e. stand for transfers);
  * a SEND -> its matching RECV (the transfer needs both sides);
  * per channel (src -> dst), transfers complete in the sender's order *and* in the receiver's posting order
    (messages match in posting order; if the two orders differ, the graph gets a cycle).
The schedule is deadlock-free iff this graph is acyclic. The event simulator implements the same rules
without materialising the graph; this module is for explanations (the cycle in an error) and for tests.
"""
from __future__ import annotations

from collections import defaultdict

import networkx as nx

from schedules.deps import Topology, needs, produces
from schedules.ir import COMM_KINDS, Action, Kind, Schedule

Node = tuple[int, int]  # (rank, index in the rank's action list)
_SEND_TO_RECV = {Kind.SEND_F: Kind.RECV_F, Kind.SEND_B: Kind.RECV_B}


def dependency_graph(schedule: Schedule) -> nx.DiGraph:
    topo = Topology(schedule)
    g = nx.DiGraph()
    producer: dict[tuple, Node] = {}
    send_node: dict[tuple[int, Action], Node] = {}  # (src, RECV-shaped message) -> SEND node
    sender_order: dict[tuple[int, int], list[Action]] = defaultdict(list)
    receiver_order: dict[tuple[int, int], list[Node]] = defaultdict(list)
    recv_node: dict[tuple[int, Action], Node] = {}

    for r, acts in enumerate(schedule.actions):
        last_compute: Node | None = None
        pending_sends: list[Node] = []
        for i, a in enumerate(acts):
            node = (r, i)
            g.add_node(node, action=a, rank=r)
            if a.kind in COMM_KINDS:
                if last_compute is not None:
                    g.add_edge(last_compute, node)
                if a.kind in _SEND_TO_RECV:
                    pending_sends.append(node)
                    msg = Action(_SEND_TO_RECV[a.kind], a.stage, a.mb, peer=r)
                    send_node[(a.peer, msg)] = node
                    sender_order[(r, a.peer)].append(msg)
                else:
                    recv_node[(r, a)] = node
                    receiver_order[(a.peer, r)].append(node)
            else:
                if last_compute is not None:
                    g.add_edge(last_compute, node)
                for send in pending_sends:  # a SEND is posted (its tensor exists) before the next compute issues
                    g.add_edge(send, node)
                pending_sends = []
                last_compute = node
            for key in produces(a):
                producer[key] = node

    for r, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            for key in needs(a, r, topo):
                if key in producer:
                    g.add_edge(producer[key], (r, i))
    for (dst, msg), node in recv_node.items():
        if (dst, msg) in send_node:
            g.add_edge(send_node[(dst, msg)], node)
    for (src, dst), msgs in sender_order.items():
        nodes = [recv_node.get((dst, m)) for m in msgs]
        for u, v in zip(nodes, nodes[1:]):
            if u is not None and v is not None:
                g.add_edge(u, v)
    for nodes in receiver_order.values():
        for u, v in zip(nodes, nodes[1:]):
            g.add_edge(u, v)
    return g


def find_cycle(schedule: Schedule) -> list[Node] | None:
    """Nodes of one dependency cycle, or None when the schedule is deadlock-free."""
    g = dependency_graph(schedule)
    try:
        edges = nx.find_cycle(g)
    except nx.NetworkXNoCycle:
        return None
    return [u for u, _ in edges]


def describe_cycle(schedule: Schedule, cycle: list[Node], limit: int = 16) -> str:
    names = [_node_name(schedule, node) for node in cycle]
    if len(names) > limit:
        names = names[: limit // 2] + [f"... {len(names) - limit} more ..."] + names[-limit // 2:]
    return " -> ".join(names + [names[0]])


def _node_name(schedule: Schedule, node: Node) -> str:
    r, i = node
    a = schedule.actions[r][i]
    if a.kind in (Kind.RECV_F, Kind.RECV_B):  # a RECV node stands for the whole transfer
        send = "SEND_F" if a.kind is Kind.RECV_F else "SEND_B"
        return f"transfer {send}/s{a.stage}/mb{a.mb} rank {a.peer} -> rank {r} (RECV #{i})"
    return f"rank {r}: {a} (#{i})"
