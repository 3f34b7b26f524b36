"""Property tests over random valid (kind, P, M), and the engine/graph agreement on random perturbations."""
import networkx as nx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schedules import Durations, Kind, ScheduleError, build, lower_comms, simulate, validate_schedule
from schedules.graph import dependency_graph
from schedules.validate import check_structure


@st.composite
def valid_request(draw):
    kind = draw(st.sampled_from(["gpipe", "1f1b", "zb1p", "dualpipe", "dualpipev"]))
    P = draw(st.integers(1, 8))
    if kind == "dualpipe":
        P = 2 * draw(st.integers(1, 4))
    low = {"gpipe": 1, "1f1b": P, "zb1p": P, "dualpipe": 2 * P, "dualpipev": 2 * P}[kind]
    M = draw(st.integers(low, low + 12))
    if kind == "dualpipe":
        M += M % 2
    return kind, P, M


@settings(max_examples=60, deadline=None)
@given(valid_request(), st.floats(0.5, 3), st.floats(0.5, 3), st.floats(0.5, 3), st.floats(0, 2))
def test_random_valid_schedules(request, f, i, w, latency):
    kind, P, M = request
    s = build(kind, P, M)
    validate_schedule(s)
    r = simulate(s, Durations(F=f, I=i, W=w, p2p_latency=latency))
    # each rank's busy time is exactly the work it was given
    for rank, acts in enumerate(s.actions):
        work = sum(f if p.kind is Kind.F else i + w if p.kind is Kind.B else i if p.kind is Kind.I else w
                   for a in acts for p in a.parts())
        assert abs(r.busy[rank] - work) < 1e-6 * max(1, work)
    # no rank can finish before its own work, and idle is never negative
    assert min(r.idle.values()) >= -1e-9
    # every chunk's forward ends before the next stage's forward of the same micro-batch starts
    starts = {(x.stage, x.mb): x for x in r.trace.spans if x.kind in ("F", "FB")}
    nxt = s.next_stage()
    for (stage, mb), span in starts.items():
        n = nxt.get(stage)
        if n is not None and (n, mb) in starts:
            assert starts[(n, mb)].start >= span.end - 1e-9


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_request(), st.data())
def test_engine_and_graph_agree_on_deadlocks(request, data):
    """Swap two actions of one rank: validation (event engine) rejects a deadlock iff the graph has a cycle."""
    kind, P, M = request
    if P * M > 48:
        return
    s = lower_comms(build(kind, P, M))
    rank = data.draw(st.integers(0, P - 1))
    acts = list(s.actions[rank])
    i = data.draw(st.integers(0, len(acts) - 1))
    j = data.draw(st.integers(0, len(acts) - 1))
    acts[i], acts[j] = acts[j], acts[i]
    actions = list(s.actions)
    actions[rank] = tuple(acts)
    mutated = s.with_actions(tuple(actions))
    try:
        check_structure(mutated)
    except ScheduleError:
        return  # a counting/order/pairing rule fired first; nothing to compare
    cyclic = not nx.is_directed_acyclic_graph(dependency_graph(mutated))
    try:
        validate_schedule(mutated)
        rejected = False
    except ScheduleError as err:
        rejected = True
        assert "deadlock" in str(err)
    assert rejected == cyclic
