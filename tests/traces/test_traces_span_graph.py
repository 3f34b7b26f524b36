"""The dependency graph of a measured step (traces.analysis.span_graph, traces.analysis.transfers) on hand-made
runtime traces whose
answer is known: when a transfer arrived ("at the wait" completions), which input released an op, what a wait
inside an op is, and which global rank a P2P peer is under data parallelism."""
from __future__ import annotations

import pytest

from traces.analysis.critical_path import critical_path
from traces.analysis.replicas import one_replica
from traces.analysis.span_graph import build_span_graph
from traces.trace import Span, Trace
from traces.analysis.whatif import whatif

META = {"source": "measured", "wait_spans": True, "p2p_completion": "at the wait", "time_unit": "us",
        "schedule": {"kind": "1f1b", "ranks": 2, "microbatches": 1}}


def two_ranks(busy_until: float | None = None) -> Trace:
    """F on rank 0 [0, 10], its output sent to rank 1, F on rank 1 after it. The SEND span opens when the post
    returned (10.5) and closes at rank 0's end-of-step drain (the send completed, buffered, before the receiver
    saw it); rank 1 posted its receive at 1. `busy_until`: rank 1
    first runs an op of another micro-batch until then (the message is long there when it waits), else it waits
    from 2 on, before the message was even sent."""
    spans = [Span(0, "compute", "F", 0, 0, 0.0, 10.0),
             Span(0, "comm", "SEND_F", 0, 0, 10.5, 0.2, peer=1),
             Span(0, "compute", "WAIT", 0, 0, 10.6, 0.1, name="WAIT/SEND_F/s0/mb0"),
             Span(1, "comm", "RECV_F", 0, 0, 1.0, 11.2, peer=0)]
    if busy_until is None:
        spans += [Span(1, "compute", "WAIT", 0, 0, 2.0, 10.0, name="WAIT/RECV_F/s0/mb0"),
                  Span(1, "compute", "F", 1, 0, 12.3, 7.7)]
    else:
        spans[-1] = Span(1, "comm", "RECV_F", 0, 0, 1.0, busy_until + 0.2 - 1.0, peer=0)
        spans += [Span(1, "compute", "F", 0, 5, 1.5, busy_until - 1.5),  # an op that needs no input
                  Span(1, "compute", "WAIT", 0, 0, busy_until + 0.05, 0.1, name="WAIT/RECV_F/s0/mb0"),
                  Span(1, "compute", "F", 1, 0, busy_until + 0.3, 7.7)]
    return Trace(spans, dict(META))


def test_a_receiver_waiting_before_the_send_puts_the_transfer_on_the_path():
    t = two_ranks()
    g = build_span_graph(t)
    (x,) = [n for n in g.nodes if n.kind == "P2P"]
    assert (x.start, x.end) == (10.0, 12.0)  # the sender began posting when its F ended; arrival = the wait's end
    cp = critical_path(t)
    assert [p.label for p in cp.path][:3] == ["F/s0/mb0", "P2P_F/s0/mb0 r0->r1", "WAIT/RECV_F/s0/mb0"]
    assert cp.exposed_comm_us == pytest.approx(2.0) and cp.path[2].duration_us == 0.0
    assert cp.length_us + cp.gaps_us == pytest.approx(cp.makespan_us) and cp.makespan_us == pytest.approx(20.0)
    assert cp.gaps_us == pytest.approx(0.3)  # between the wait's end and F/s1/mb0


def test_a_message_that_arrived_before_the_wait_leaves_the_path_on_the_receivers_thread():
    t = two_ranks(busy_until=30.0)
    g = build_span_graph(t)
    (x,) = [n for n in g.nodes if n.kind == "P2P"]
    assert (x.start, x.end) == (10.0, 10.0)  # no blocked receiver in the trace to learn the wire time from
    cp = critical_path(t)
    assert "P2P" not in cp.by_kind and [p.label for p in cp.path][:2] == ["F/s0/mb5", "WAIT/RECV_F/s0/mb0"]
    assert cp.path[1].duration_us == pytest.approx(0.1)  # the wait's own time: the message was there
    w = whatif(t, {"comm": 0.0})
    assert w.step_us == pytest.approx(w.measured_step_us)  # faster communication gains nothing here


def test_waits_inside_an_op_are_its_part_and_scale_with_comm():
    """An expert layer's all-to-all posted and waited for inside F: the wait is part of F, not a thread op."""
    spans = [Span(0, "compute", "F", 0, 0, 0.0, 10.0),
             Span(0, "comm", "A2A_DISPATCH", 0, 0, 2.0, 4.0, name="A2A_DISPATCH/s0/mb0/L1~comm"),
             Span(0, "compute", "WAIT", 0, 0, 3.0, 3.0, name="WAIT/A2A_DISPATCH/s0/mb0/L1"),
             Span(0, "compute", "W", 0, 0, 10.0, 1.0), Span(0, "compute", "I", 0, 0, 11.0, 2.0)]
    t = Trace(spans, {**META, "schedule": {"kind": "1f1b", "ranks": 1, "microbatches": 1}})
    g = build_span_graph(t)
    f = next(n for n in g.nodes if n.label == "F/s0/mb0")
    assert f.parts == {"wait": 3.0} and not [n for n in g.nodes if n.kind in ("WAIT", "A2A_DISPATCH")]
    assert critical_path(t).exposed_comm_us == pytest.approx(3.0)
    assert whatif(t, {"comm": 0.0}).step_us == pytest.approx(t.makespan() - 3.0)


def test_data_parallel_runs_are_read_one_pipeline_at_a_time():
    """pp=2 x dp=2: global rank = pipeline rank * 2 + replica, peers recorded as global ranks (as the runtime
    writes them). Stage names repeat in both replicas, so the graph reads one pipeline: the slowest replica's,
    its ranks renumbered to pipeline ranks, and the critical path says which global ranks those are."""
    spans = []
    for rep in (0, 1):
        spans += [Span(rep, "compute", "F", 0, 0, 0.0, 5.0 + rep),
                  Span(rep, "comm", "SEND_F", 0, 0, 5.0 + rep, 1.0, peer=2 + rep),
                  Span(2 + rep, "comm", "RECV_F", 0, 0, 5.0 + rep, 1.0, peer=rep),
                  Span(2 + rep, "compute", "F", 1, 0, 6.0 + rep, 3.0)]
    t = Trace(spans, {**META, "p2p_completion": "stamped", "layout": {"pp": 2, "dp": 2},
                      "schedule": {"kind": "1f1b", "ranks": 2, "microbatches": 2}})
    g = build_span_graph(t)
    assert sorted(n.label for n in g.nodes if n.kind == "P2P") == ["P2P_F/s0/mb0 r0->r1"]
    cp = critical_path(t)
    assert [p.label for p in cp.path] == ["F/s0/mb0", "P2P_F/s0/mb0 r0->r1", "F/s1/mb0"]
    assert cp.makespan_us == pytest.approx(10.0)  # replica 1 (starts its P2P at 6, ends at 10), not replica 0
    assert cp.scope == "data-parallel replica 1 (the slowest), pipeline ranks 0 = global 1, 1 = global 3"
    assert one_replica(t, 0).meta["global_ranks"] == {0: 0, 1: 2}


def test_an_edge_added_twice_keeps_the_stronger_constraint():
    """span_graph._Builder.edge: the same pair added again keeps finish-to-start over start-to-start over
    finish-to-finish, and within a type the larger lag (the fast path for a satisfied finish-to-start edge
    included); a contradicted edge is listed, not added."""
    from traces.analysis.span_graph import _Builder
    from traces.analysis.span_nodes import Node

    b = _Builder(Trace(spans=[], meta={}), 1e-9)
    for i, (start, end) in enumerate([(0.0, 10.0), (5.0, 20.0), (30.0, 40.0)]):
        b._add(Node(i, 0, "compute", "F", f"n{i}", start, end, (i,)))
    b.edge(0, 1, fallback=("ss",))  # 1 starts before 0 ends: start-to-start, lagged as recorded
    assert b.edges[(0, 1)] == ["ss", 5.0]
    b.edge(0, 1, kind="ff")
    assert b.edges[(0, 1)] == ["ss", 5.0]  # weaker: kept as it was
    b.edge(0, 2, kind="ff")
    assert b.edges[(0, 2)] == ["ff", 0.0]
    b.edge(0, 2)  # finish-to-start replaces finish-to-finish
    assert b.edges[(0, 2)] == ["fs", 0.0]
    b.edge(0, 2, lag=15.0)
    assert b.edges[(0, 2)] == ["fs", 15.0]
    b.edge(0, 2, lag=3.0)
    assert b.edges[(0, 2)] == ["fs", 15.0]
    b.edge(1, 2, kind="ss", lag=0.0)
    b.edge(1, 2)
    assert b.edges[(1, 2)] == ["fs", 0.0]
    b.edge(2, 0)  # 0 starts 40 before 2 ends: contradicted
    assert (2, 0) not in b.edges and len(b.violations) == 1


def test_a_wait_binds_to_the_last_instance_of_its_op_posted_before_it():
    """The same all-to-all posted twice between ops (a name that repeats within a step): a wait on it waited
    for the instance posted last before the wait began, not an earlier one that had long completed."""
    name = "A2A_DISPATCH/s0/mb0/L1"
    spans = [Span(0, "compute", "F", 0, 0, 0.0, 5.0),
             Span(0, "comm", "A2A_DISPATCH", 0, 0, 5.0, 1.0, name=f"{name}~comm"),
             Span(0, "compute", "F", 0, 1, 6.0, 2.0),
             Span(0, "comm", "A2A_DISPATCH", 0, 0, 8.0, 4.0, name=f"{name}~comm"),
             Span(0, "compute", "WAIT", 0, 0, 8.5, 3.5, name=f"WAIT/{name}")]
    t = Trace(spans, {**META, "schedule": {"kind": "1f1b", "ranks": 1, "microbatches": 2}})
    g = build_span_graph(t)
    first, second = sorted((n for n in g.nodes if n.kind == "A2A_DISPATCH"), key=lambda n: n.start)
    (wait,) = [n for n in g.nodes if n.kind == "WAIT"]
    assert (wait.start, wait.end) == (12.0, 12.0)  # blocked until the second exchange completed
    assert (second.id, wait.id) in g.edges and (first.id, wait.id) not in g.edges
