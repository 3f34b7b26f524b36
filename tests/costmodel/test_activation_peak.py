"""The activation peak over a rank's program (costmodel.physics.memory.activation_peak), vectorised over chunk
events so the tuner can price thousands of candidates on a few programs, against the walk it replaced: the same
peak to the last bit (numpy's cumsum adds in program order) and the same live chunks at the first peak."""
from __future__ import annotations

import random
from types import SimpleNamespace

from costmodel.physics.memory import activation_peak, program_events
from schedules import build
from schedules.ir import Kind


def _walk(actions, stages):
    live, total, peak, at_peak = {}, 0.0, 0.0, {}
    for a in actions:
        if a.kind is Kind.F or a.kind is Kind.FB:
            live[a.stage] = live.get(a.stage, 0) + 1
            total += stages[a.stage].chunk_activation_bytes
            if total > peak:
                peak, at_peak = total, {s: k for s, k in live.items() if k}
        freed = a.b_stage if a.kind is Kind.FB else a.stage if a.kind in (Kind.B, Kind.I) else None
        if freed is not None:
            live[freed] -= 1
            total -= stages[freed].chunk_activation_bytes
    return peak, at_peak


def test_the_vectorised_peak_equals_the_walk_bit_for_bit():
    rng = random.Random(7)
    for kind, P, M in (("gpipe", 4, 8), ("1f1b", 4, 8), ("zb1p", 4, 12), ("dualpipe", 4, 8), ("dualpipev", 4, 8),
                       ("dualpipev", 8, 24), ("1f1b", 16, 120)):
        s = build(kind, P, M)
        for trial in range(3):
            # equal weights make ties, random ones a unique peak; 0.1-style decimals make rounding matter
            stages = {st: SimpleNamespace(chunk_activation_bytes=1.0 if trial == 0 else rng.random() * 1e9 + 0.1)
                      for st in range(s.num_stages)}
            for acts in s.actions:
                assert activation_peak(acts, stages) == _walk(acts, stages), (kind, P, M, trial)
                assert activation_peak(program_events(acts), stages) == _walk(acts, stages)


def test_the_first_of_equal_peaks_is_the_one_reported():
    """Two equal peaks holding different chunks: both forms report the first (what the walk reports)."""
    from schedules.ir import Action

    acts = [Action(Kind.F, 0, 0), Action(Kind.B, 0, 0), Action(Kind.F, 1, 0), Action(Kind.B, 1, 0)]
    stages = {0: SimpleNamespace(chunk_activation_bytes=1.0), 1: SimpleNamespace(chunk_activation_bytes=1.0)}
    assert _walk(acts, stages) == (1.0, {0: 1})
    assert activation_peak(acts, stages) == (1.0, {0: 1})
    assert activation_peak(program_events(acts), stages) == (1.0, {0: 1})
