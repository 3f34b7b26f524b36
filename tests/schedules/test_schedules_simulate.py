"""Simulation: the closed-form bubbles and peak activations of schedules.md §7 at unit costs, and the
simulator's response to costs (P2P time, per-stage durations)."""
import pytest

from schedules import Durations, build, simulate
from schedules.ir import Action, Kind
from schedules.formulas import bubble_formula

UNIT = Durations(F=1, I=1, W=1)  # B = 2, F&B = 3, as DeepSeek's figures


@pytest.mark.parametrize("P", [2, 4, 8, 16])
@pytest.mark.parametrize("kind, Ms", [("1f1b", lambda P: (P, 2 * P + 3)), ("zb1p", lambda P: (P, 3 * P)),
                                      ("dualpipe", lambda P: (2 * P, 2 * P + 6)),
                                      ("dualpipev", lambda P: (2 * P, 2 * P + 5))])
def test_bubble_matches_formula_at_unit_costs(kind, Ms, P):
    for M in Ms(P):
        r = simulate(build(kind, P, M), UNIT)
        expected = {"1f1b": (P - 1) * 3, "zb1p": (P - 1) * 1,
                    "dualpipe": (P / 2 - 1) * 2, "dualpipev": (P - 1) * 2}[kind]
        assert set(r.idle.values()) == {expected}, (kind, P, M, r.idle)
        assert bubble_formula(build(kind, P, M), UNIT)[1] == expected


@pytest.mark.parametrize("P, M", [(2, 4), (4, 10), (8, 20), (16, 32)])
def test_dualpipe_makespans(P, M):
    """schedules.md §8.6: makespan 3M + N - 2 (DualPipe), 6M + 2(N - 1) (DualPipeV)."""
    assert simulate(build("dualpipe", P, M), UNIT).makespan == 3 * M + P - 2
    assert simulate(build("dualpipev", P, M), UNIT).makespan == 6 * M + 2 * (P - 1)


@pytest.mark.parametrize("P", [2, 4, 8])
def test_peak_activations(P):
    for M in (2 * P, 4 * P):
        assert max(simulate(build("1f1b", P, M), UNIT).peak_activations.values()) <= P
        assert max(simulate(build("zb1p", P, M), UNIT).peak_activations.values()) <= P
        # DualPipe: PP+1 = P+1 chunks on every rank; DualPipeV: 2P+1 half-stage chunks = P + 1/2 stages
        assert set(simulate(build("dualpipe", P, M), UNIT).peak_activations.values()) == {P + 1}
        assert set(simulate(build("dualpipev", P, M), UNIT).peak_activations.values()) == {2 * P + 1}
    assert max(simulate(build("gpipe", P, 3 * P), UNIT).peak_activations.values()) == 3 * P


def test_trace_contents():
    s = build("dualpipev", 4, 10)
    r = simulate(s, UNIT)
    compute = [x for x in r.trace.spans if x.stream == "compute"]
    assert len(compute) == sum(len(a) for a in s.actions)
    assert r.trace.meta["source"] == "simulated"
    # compute spans never overlap on a rank
    for rank in range(4):
        spans = sorted((x.start, x.end) for x in compute if x.rank == rank)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))
    # every SEND has a RECV span with the same interval on the peer (P2P pairs)
    sends = {(x.kind[-1], x.stage, x.mb, x.peer): x for x in r.trace.spans if x.kind.startswith("SEND")}
    recvs = {(x.kind[-1], x.stage, x.mb, x.rank): x for x in r.trace.spans if x.kind.startswith("RECV")}
    assert sends.keys() == recvs.keys() and sends
    # V placement: 2 * (P - 1) boundaries per micro-batch and direction, F and B
    assert len(sends) == 2 * 2 * (4 - 1) * 10


def test_p2p_time_costs_makespan_monotonically():
    s = build("1f1b", 4, 8)
    spans = [simulate(s, Durations(p2p_latency=lat)).makespan for lat in (0, 0.5, 1, 2)]
    assert spans == sorted(spans) and spans[-1] > spans[0]
    # alpha-beta: 84 MB over 3800 bytes/us = 22.1 us per message
    slow = simulate(s, Durations(F=10, I=10, W=10, p2p_bandwidth=3800, message_bytes=84e6))
    msg = next(x for x in slow.trace.spans if x.kind == "SEND_F")
    assert msg.duration == pytest.approx(84e6 / 3800)


def test_per_stage_durations_stretch_the_slow_stage():
    s = build("1f1b", 4, 8)
    base = simulate(s, UNIT)
    slow = simulate(s, Durations(F=1, I=1, W=1, per_stage={2: {"F": 3}}))
    f2 = [x for x in slow.trace.spans if x.kind == "F" and x.stage == 2]
    assert {x.duration for x in f2} == {3}
    assert slow.makespan > base.makespan
    # the slow stage bounds the steady state: M forwards of 3 + M backwards of 2
    assert slow.makespan >= 8 * (3 + 2)


def test_durations_parse():
    d = Durations.parse("F=1,B=2,W=1")
    assert (d.F, d.I, d.W) == (1, 1, 1)
    d = Durations.parse("F=2,I=3,W=1,FB=6")
    assert d.FB == 6
    for bad in ("F", "X=1", "F=a", "F=-1", "B=1,W=2"):
        with pytest.raises(ValueError, match="--cost"):
            Durations.parse(bad)


@pytest.mark.parametrize("kind", ["1f1b", "zb1p", "dualpipe", "dualpipev", "gpipe"])
def test_grad_done_is_each_stages_last_gradient_write_with_or_without_spans(kind):
    """The engine's per-stage last gradient write (what the gradient all-reduce starts from) equals the latest end
    of the stage's W, I, B and F&B backward halves read off the spans, and a simulation without spans (the tuner's)
    gives the same numbers and no spans."""
    import random

    rng = random.Random(7)
    cost = {}

    def compute_time(a):
        return cost.setdefault((a.kind, a.stage, a.b_stage), float(rng.randint(1, 9)))

    schedule = build(kind, 4, 8)
    sim = simulate(schedule, compute_time=compute_time, transfer_time=lambda a: 0.5, p2p="rendezvous")
    want: dict[int, float] = {}
    for s in sim.trace.spans:
        stage = s.partner[0] if s.kind == "FB" else s.stage if s.kind in ("W", "I", "B") else None
        if s.stream == "compute" and stage is not None:
            want[stage] = max(want.get(stage, 0.0), s.end)
    assert sim.grad_done == want and len(want) == schedule.num_stages
    bare = simulate(schedule, compute_time=compute_time, transfer_time=lambda a: 0.5, p2p="rendezvous", record=False)
    assert not bare.trace.spans
    assert (bare.makespan, bare.busy, bare.grad_done) == (sim.makespan, sim.busy, sim.grad_done)


@pytest.mark.parametrize("p2p", ["commit", "rendezvous", "dataflow"])
@pytest.mark.parametrize("kind", ["1f1b", "zb1p", "dualpipe", "dualpipev", "gpipe"])
def test_last_backward_chains_bound_what_follows_each_rank(kind, p2p):
    """deps.last_backward_chains: after a rank's last action ends, its chain of upstream backwards and the sends
    between their ranks still run before the step ends (the tuner's bound adds this after each rank's busy time),
    with costs that differ per stage and kind; in 1F1B the first stage's rank ends exactly that much after the
    last stage's rank."""
    import random

    from schedules.deps import last_backward_chains

    rng = random.Random(7)
    cost: dict = {}

    def compute_time(a):
        return cost.setdefault((a.kind, a.stage, a.b_stage), float(rng.randint(1, 9)))

    def fb_timing(a, lag_f, lag_b):  # each half starts with its input; the input gradient leaves 1 unit in
        f, b = compute_time(a._replace(kind=Kind.F)), compute_time(Action(Kind.B, a.b_stage, a.b_mb))
        return max(lag_f + f, lag_b + b), lag_f + f, lag_b + 1.0

    schedule = build(kind, 4, 8)
    sim = simulate(schedule, compute_time=compute_time, transfer_time=lambda a: 0.5, p2p=p2p, fb_timing=fb_timing)
    last = {}
    for s in sim.trace.spans:
        if s.stream == "compute":
            last[s.rank] = max(last.get(s.rank, s.end), s.end)
    chains = last_backward_chains(schedule)
    for r, chain in enumerate(chains):
        t, up = last[r], r
        for k, stage, dst in chain:
            t += (0.5 if dst != up else 0.0) + cost[(k, stage, -1)]
            up = dst
        assert t <= sim.makespan + 1e-9, (r, chain)
    if kind in ("1f1b", "gpipe"):  # equal stages: tight
        assert [len(c) for c in chains] == [0, 1, 2, 3]
        even = simulate(schedule, Durations(F=2.0, I=1.0, W=1.0, p2p_latency=0.5), p2p=p2p)
        end3 = max(s.end for s in even.trace.spans if s.rank == 3 and s.stream == "compute")
        assert even.makespan == end3 + 3 * (0.5 + 2.0)


@pytest.mark.parametrize("kind", ["1f1b", "zb1p", "dualpipe", "dualpipev", "gpipe"])
def test_first_forward_chains_bound_when_each_rank_starts(kind):
    """deps.first_forward_chains: a rank's first action starts no earlier than its chain of upstream forwards and
    the sends between their ranks (the tuner's bound adds this to each rank's busy time); in a pipeline without
    F&B pairs the last rank waits for every upstream stage."""
    from schedules.deps import first_forward_chains

    schedule = build(kind, 4, 8)
    chains = first_forward_chains(schedule)
    sim = simulate(schedule, Durations(F=2.0, I=1.0, W=1.0, p2p_latency=0.5), p2p="rendezvous")
    first = {}
    for s in sim.trace.spans:
        if s.stream == "compute":
            first[s.rank] = min(first.get(s.rank, s.start), s.start)
    for r, chain in enumerate(chains):
        down, fill = r, 0.0
        for _stage, src in chain:
            fill += 2.0 + (0.5 if src != down else 0.0)
            down = src
        assert first[r] >= fill - 1e-9, (r, chain)
    if kind in ("1f1b", "gpipe", "zb1p"):
        assert [len(c) for c in chains] == [0, 1, 2, 3]
        assert first[3] == pytest.approx(3 * 2.5)  # tight: three forwards and three sends
