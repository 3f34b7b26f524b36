"""Interleaved A/B runs (pipeline.launch.local.interleaved_worker): the variants take turns step by step in the order
A B B A A B, and taking turns changes nothing about what each variant computes."""
from __future__ import annotations

import pytest

from _pipeline_helpers import check_ok, tiny_config
from pipeline.launch.local import interleaved_worker, variants_worker
from rank_pool import launch
from traces.trace import Trace


@pytest.mark.timeout(120)
def test_interleaved_variants_take_turns_and_train_as_alone(tmp_path):
    variants = [tiny_config("dualpipev", 2, n=1, steps=3), tiny_config("dualpipev", 2, n=4, steps=3)]
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    inter = launch(interleaved_worker, 2, (variants, dirs), timeout_s=100)
    check_ok(inter)
    alone = launch(variants_worker, 2, (variants, False), timeout_s=100)
    check_ok(alone)
    for vi in range(len(variants)):
        got = [s["loss"] for s in inter[0].value[vi]]
        want = [s["loss"] for s in alone[0].value[vi]["stats"]]
        assert got == want, f"variant {vi}: interleaved losses {got} != separate run {want}"
    steps = []
    for label, d in zip("AB", dirs):
        trace = Trace.load(f"{d}/trace.json")
        steps += [(s.start, s.end, label) for s in trace.spans if s.kind == "step" and s.rank == 0]
    steps.sort()
    assert "".join(label for _, _, label in steps) == "ABBAAB"
    assert all(a[1] <= b[0] for a, b in zip(steps, steps[1:])), "variants' steps overlap in time"


def test_interleaved_runs_need_equal_steps(tmp_path):
    variants = [tiny_config("dualpipev", 2, n=1, steps=3), tiny_config("dualpipev", 2, n=4, steps=2)]
    res = launch(interleaved_worker, 2, (variants, [str(tmp_path / "a"), str(tmp_path / "b")]), timeout_s=60)
    assert all(r.exitcode != 0 for r in res)
    assert "train.steps" in res[0].error and "3 steps" in res[0].error
