"""schedules/memo.py: a value derived from one schedule object is computed once, per object, and goes with it."""
import gc
from functools import partial

from schedules import build, simulate
from schedules.memo import _VALUES, derived


def test_derived_once_per_object_and_dropped_with_it():
    calls = []
    a, b = build("1f1b", 4, 8), build("1f1b", 4, 8)  # equal schedules, two objects

    def make(s):
        calls.append(id(s))
        return len(s.actions)

    assert derived(a, "n", partial(make, a)) == derived(a, "n", partial(make, a)) == 4
    assert derived(b, "n", partial(make, b)) == 4
    assert calls == [id(a), id(b)]
    key = (id(a), "n")
    assert key in _VALUES
    del a
    gc.collect()
    assert key not in _VALUES  # a later schedule that reuses the id recomputes


def test_simulations_that_share_a_schedule_give_what_fresh_ones_give():
    s = build("zb1p", 4, 12)
    first = simulate(s)
    again = simulate(s)  # the engine's channels and the live counts come from the memo now
    fresh = simulate(build("zb1p", 4, 12))
    assert again.makespan == first.makespan == fresh.makespan
    assert again.peak_activations == first.peak_activations == fresh.peak_activations
    again.peak_activations[0] = -1  # the caller's copy: the memo's value is not changed through it
    assert simulate(s).peak_activations == fresh.peak_activations
