"""Processor sharing along a schedule (costmodel.shared_cores) and the cores(k) measurement (core_sharing)."""
import random

import pytest

from costmodel.core_sharing import measure_core_sharing
from costmodel.shared_cores import sharing_rate, simulate_shared
from pipeline.config import load_config
from schedules.build import build
from schedules.ir import Kind
from schedules.simulate import simulate


def _costs(seed):
    rnd, table = random.Random(seed), {}

    def work(a):
        return table.setdefault((a.kind, a.stage, a.b_stage if a.kind is Kind.FB else None), rnd.uniform(1, 3))

    return work


def _transfer(a):
    return 0.7 if a.kind is Kind.RECV_F else 0.4


@pytest.mark.parametrize("kind,P,M", [("dualpipev", 4, 8), ("1f1b", 4, 8), ("zb1p", 4, 8), ("dualpipe", 4, 8),
                                      ("gpipe", 3, 5)])
def test_enough_cores_is_the_event_simulator(kind, P, M):
    sched = build(kind, P, M)
    work = _costs(P * M)
    ref = simulate(sched, compute_time=work, transfer_time=_transfer)
    got = simulate_shared(sched, work, _transfer, [float(P)])
    key = lambda s: (s.rank, s.stream, s.kind, s.stage, s.mb, round(s.start, 9), round(s.duration, 9))  # noqa: E731
    assert sorted(map(key, got.trace.spans)) == sorted(map(key, ref.trace.spans))
    assert got.makespan == pytest.approx(ref.makespan)


def test_one_core_serialises_compute():
    sched = build("1f1b", 4, 8)
    work = _costs(1)
    free = simulate_shared(sched, work, _transfer, [4.0])
    one = simulate_shared(sched, work, _transfer, [1.0])
    total = sum(s.duration for s in free.trace.spans if s.stream == "compute")
    # at most one rank's worth of progress at any moment: the run takes at least the summed work
    assert one.makespan >= total - 1e-9
    # and the simulated spans never hold more than one core of progress at once
    ends = sorted((s.start, s.end) for s in one.trace.spans if s.stream == "compute")
    assert sum(e - s for s, e in ends) >= total - 1e-9


def test_slowdown_follows_the_ranks_computing_at_that_moment():
    """A lone action runs at full speed; the same work next to three others runs at cores(4) / 4."""
    sched = build("gpipe", 4, 4)
    work = lambda a: 10.0  # noqa: E731
    sim = simulate_shared(sched, work, lambda a: 0.0, [1.0, 2.0, 2.0, 2.0])
    f = sorted((s for s in sim.trace.spans if s.kind == "F"), key=lambda s: s.start)
    assert f[0].duration == pytest.approx(10.0)  # rank 0's first forward: nobody else computes yet
    k4 = [s for s in f if s.rank == 3 and s.mb == 0]
    assert k4 and k4[0].duration > 10.0  # by then four ranks compute
    full = [s for s in sim.trace.spans if s.stream == "compute" and s.duration == pytest.approx(20.0)]
    assert full  # two ranks at once on two cores: full speed; four: half speed (10 -> 20)


def test_gap_is_work_before_the_span():
    sched = build("gpipe", 2, 2)
    sim = simulate_shared(sched, lambda a: 5.0, lambda a: 0.0, [2.0], gap_us=1.0)
    first = min(sim.trace.spans, key=lambda s: s.start)
    assert first.start == pytest.approx(1.0) and first.duration == pytest.approx(5.0)
    assert sim.busy[0] == pytest.approx(sum(s.duration + 1.0 for s in sim.trace.spans
                                            if s.rank == 0 and s.stream == "compute"))


def test_rate_rules():
    rate = sharing_rate([1.0, 1.8])
    assert rate(1) == 1.0 and rate(2) == pytest.approx(0.9) and rate(4) == pytest.approx(0.45)
    with pytest.raises(ValueError, match="positive"):
        sharing_rate([1.0, 0.0])


@pytest.mark.timeout(180)
def test_measure_core_sharing_runs_the_block():
    cores = measure_core_sharing(load_config("tiny"), 2, seconds=0.2, cycles=1)
    assert len(cores) == 2
    assert 0.5 < cores[0] < 1.5  # one process against itself
    assert 0.3 < cores[1] < 2.6  # two processes on a shared CI machine: anything but nonsense
