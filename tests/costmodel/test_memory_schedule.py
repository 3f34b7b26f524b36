"""The activation peak follows the schedule: each live chunk weighs its own stage's bytes (costmodel.physics.memory
.activation_peak), checked against a count written independently (every prefix of the program recounted from
scratch) on all five schedules, and on the paper's DualPipe PP6 EP8 layout, where the old count (live chunks x
the largest chunk) said 85.6 GiB for rank 0 and "exceeds the h800's 80 GiB"."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from configs import load_config
from costmodel.physics.memory import activation_peak
from costmodel.answers.predict import predict
from schedules import build
from schedules.ir import Kind
from schedules.simulate import peak_live_activations

KINDS = ("gpipe", "1f1b", "zb1p", "dualpipe", "dualpipev")


def _recount(actions, weight) -> float:
    """Independent count: expand F&B into its forward then its backward, and after every step recount the live
    chunks (forward seen, backward not yet) from the start of the program."""
    steps = []
    for a in actions:
        if a.kind is Kind.FB:
            steps += [("F", a.stage, a.mb), ("B", a.b_stage, a.b_mb)]
        elif a.kind is Kind.F:
            steps.append(("F", a.stage, a.mb))
        elif a.kind in (Kind.B, Kind.I):
            steps.append(("B", a.stage, a.mb))
    best = 0.0
    for k in range(1, len(steps) + 1):
        done = {(s, m) for kind, s, m in steps[:k] if kind == "B"}
        live = {(s, m) for kind, s, m in steps[:k] if kind == "F"} - done
        best = max(best, sum(weight[s] for s, _ in live))
    return best


@pytest.mark.parametrize("kind", KINDS)
def test_peak_is_the_heaviest_moment_of_the_program(kind):
    P = 4
    schedule = build(kind, P, 2 * P if kind != "gpipe" else P)
    rng = random.Random(kind)
    n_stages = len(schedule.stage_to_rank)
    weight = {s: rng.choice([1.0, 2.0, 3.5, 10.0]) for s in range(n_stages)}
    stages = {s: SimpleNamespace(chunk_activation_bytes=w) for s, w in weight.items()}
    counts = peak_live_activations(schedule)
    for r, acts in enumerate(schedule.actions):
        peak, live = activation_peak(acts, stages)
        assert peak == pytest.approx(_recount(acts, weight)), (kind, r)
        assert peak == pytest.approx(sum(k * weight[s] for s, k in live.items()))
        same, _ = activation_peak(acts, {s: SimpleNamespace(chunk_activation_bytes=2.0) for s in weight})
        assert same == 2.0 * counts[r]  # equal stages: the live count times one chunk, as before


def test_paper_dualpipe_pp6_rank0_holds_six_light_chunks_and_one_heavy():
    cfg = load_config("paper-27b")
    pred = predict(cfg, "h800", ladder=False)
    assert (pred.schedule.kind, pred.schedule.num_ranks) == ("dualpipe", 6)
    r0 = pred.memory["mhc"][0]
    assert r0.live_chunks == {0: 6, 11: 1}  # six micro-batches of stage 0, one of the stage with the head
    stage = pred.pricers["mhc"].stage_mem
    assert r0.activation_bytes == pytest.approx(6 * stage[0].chunk_activation_bytes
                                                + stage[11].chunk_activation_bytes)
    assert r0.activation_bytes < 7 * max(stage[0].chunk_activation_bytes, stage[11].chunk_activation_bytes) - 2**33
    assert pred.summary["memory_gib"]["mhc"] < 80  # fits the h800 (the old count said 85.6 GiB)
