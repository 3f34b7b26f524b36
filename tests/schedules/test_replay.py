"""schedules.replay: a completed schedule rerun from the engine's order gives the engine's numbers, bit for bit."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from schedules.build import build
from schedules.engine import P2P_MODES, run_engine
from schedules.ir import Action, Kind
from schedules.lowering import lower_comms
from schedules.memo import recalled
from schedules.registry import names
from schedules.replay import compile_plan, replay, run_without_spans
from schedules.simulate import simulate


def _prices(seed: int):
    """Random per-(kind, stage) prices with fractions that make float rounding order-sensitive, per-kind message
    times, and an F&B timing whose outputs leave inside the pair (each half lags to its input)."""
    rng = random.Random(seed)
    cost: dict[tuple, float] = {}

    def compute_time(a: Action) -> float:
        return cost.setdefault((a.kind, a.stage, a.b_stage), rng.uniform(0.1, 9.0) / 3.0)

    xfer = {Kind.RECV_F: rng.uniform(0.01, 2.0) / 7.0, Kind.RECV_B: rng.uniform(0.01, 2.0) / 7.0}

    def fb_timing(a: Action, lag_f: float, lag_b: float) -> tuple[float, float, float]:
        f = compute_time(a._replace(kind=Kind.F, b_stage=-1, b_mb=-1))
        b = compute_time(Action(Kind.B, a.b_stage, a.b_mb))
        return max(lag_f + f, lag_b + b) * 1.1, lag_f + f, lag_b + b / 3.0

    return compute_time, (lambda a: xfer[a.kind]), fb_timing


def _same(got, want) -> None:
    assert got.completed and want.completed
    assert got.end == want.end  # exact: the same float operations on the same inputs
    assert got.busy == want.busy
    assert got.grad_done == want.grad_done


@pytest.mark.parametrize("kind", names())
@pytest.mark.parametrize("p2p", P2P_MODES)
@pytest.mark.parametrize("pairs", [True, False])
def test_a_replay_gives_the_engines_numbers(kind, p2p, pairs):
    lowered = lower_comms(build(kind, 4, 12))
    order: list = []
    compute_time, transfer_time, fb_timing = _prices(0)
    first = run_engine(lowered, compute_time, transfer_time, record=False, order=order)
    assert first.completed
    plan = compile_plan(lowered, order)
    for seed in range(1, 6):  # other prices than the run the plan came from
        compute_time, transfer_time, fb_timing = _prices(seed)
        fb = fb_timing if pairs else None
        want = run_engine(lowered, compute_time, transfer_time, record=False, fb_timing=fb, p2p=p2p)
        _same(replay(plan, compute_time, transfer_time, fb_timing=fb, p2p=p2p), want)


def test_simulate_without_spans_replays_from_the_second_run():
    lowered = lower_comms(build("dualpipev", 4, 16))
    compute_time, transfer_time, fb_timing = _prices(3)
    first = simulate(lowered, compute_time=compute_time, transfer_time=transfer_time, fb_timing=fb_timing,
                     validate=False, record=False)
    assert recalled(lowered, "engine replay") is not None  # compiled from the first run
    compute_time, transfer_time, fb_timing = _prices(4)
    again = simulate(lowered, compute_time=compute_time, transfer_time=transfer_time, fb_timing=fb_timing,
                     validate=False, record=False)
    spans = simulate(lowered, compute_time=compute_time, transfer_time=transfer_time, fb_timing=fb_timing,
                     validate=False)
    assert again.makespan == spans.makespan and again.busy == spans.busy and again.grad_done == spans.grad_done
    assert again.makespan != first.makespan  # the second run priced its own prices, not the first's


def test_a_schedule_that_deadlocks_gets_no_plan():
    lowered = lower_comms(build("1f1b", 3, 6))
    # rank 1 posts the receive of its first forward's input after that forward: the forward waits forever
    acts = list(lowered.actions[1])
    first = next(i for i, a in enumerate(acts) if a.kind is Kind.F)
    recv = next(i for i, a in enumerate(acts) if a.kind is Kind.RECV_F and a.mb == acts[first].mb)
    acts.insert(first + 1, acts.pop(recv))
    broken = replace(lowered, actions=(lowered.actions[0], tuple(acts), *lowered.actions[2:]))
    for _ in range(2):
        assert not run_without_spans(broken, lambda a: 1.0, lambda a: 0.0).completed
    assert recalled(broken, "engine replay") is None
