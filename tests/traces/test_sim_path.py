"""traces.analysis.sim_path: the critical path of a simulated step, walked on the path's ops alone, equals the one
the general dependency graph gives (critical_path) - the same ops, the same time per kind, summed in the same
order - over every schedule, P2P mode and F&B release rule, with unit costs (ties everywhere: the tie rules
decide) and random ones; and it declines traces it does not cover."""
from __future__ import annotations

import random

import pytest

from schedules.build import build
from schedules.engine import P2P_MODES
from schedules.ir import Kind
from schedules.registry import names
from schedules.simulate import simulate
from traces.analysis.critical_path import critical_path
from traces.analysis.sim_path import simulated_path
from traces.trace import Span, Trace


def _costs(seed: int | None):
    """compute_time, transfer_time and an fb_timing that releases the forward's output mid-pair."""
    rng = random.Random(seed)
    table: dict = {}

    def cost(key) -> float:
        if seed is None:
            return 1.0
        if key not in table:
            table[key] = float(rng.randint(1, 6))  # small integers: many exact ties remain
        return table[key]

    def compute_time(a) -> float:
        return cost((a.kind, a.stage, a.b_stage))

    def transfer_time(a) -> float:
        return 0.0 if seed is None else cost(("x", a.kind))

    def fb_timing(a, lag_f: float, lag_b: float):
        f, b = cost((Kind.F, a.stage, -1)), cost((Kind.B, a.b_stage, -1))
        f_end = lag_f + f
        end = max(f_end, lag_b) + b
        return end, f_end, end

    return compute_time, transfer_time, fb_timing


def _cases():
    for kind in names():
        for P, M in ((2, 4), (3, 6), (4, 8), (4, 12)):
            try:
                schedule = build(kind, P, M)
            except ValueError:
                continue
            yield kind, P, M, schedule


CASES = list(_cases())


@pytest.mark.parametrize("p2p", P2P_MODES)
@pytest.mark.parametrize("seed", [None, 1, 2])
@pytest.mark.parametrize("pair_release", [False, True])
def test_equals_the_general_graph(p2p, seed, pair_release):
    compared = 0
    for kind, P, M, schedule in CASES:
        compute_time, transfer_time, fb_timing = _costs(seed)
        sim = simulate(schedule, compute_time=compute_time, transfer_time=transfer_time,
                       fb_timing=fb_timing if pair_release else None, p2p=p2p)
        fast = simulated_path(sim.trace)
        assert fast is not None, (kind, P, M)
        cp = critical_path(sim.trace)
        where = f"{kind} P={P} M={M} p2p={p2p} seed={seed} release={pair_release}"
        assert fast.labels == [p.label for p in cp.path], where
        assert fast.by_kind == cp.by_kind, where  # exact: the same sums in the same order
        assert fast.exposed_comm_us == cp.exposed_comm_us, where
        assert fast.length_us == cp.length_us, where
        compared += 1
    assert compared >= 12


def test_declines_what_it_does_not_cover():
    sim = simulate(build("1f1b", 2, 4))
    spans = list(sim.trace.spans)
    assert simulated_path(Trace(spans=spans, meta={**sim.trace.meta, "source": "measured"})) is None
    part = Span(0, "compute", "F.post_res", 0, 0, spans[0].start, spans[0].duration / 2)
    assert simulated_path(Trace(spans=spans + [part], meta=sim.trace.meta)) is None
    lonely = [s for s in spans if s.kind != "SEND_F"]  # RECVs whose SEND is gone
    assert simulated_path(Trace(spans=lonely, meta=sim.trace.meta)) is None
