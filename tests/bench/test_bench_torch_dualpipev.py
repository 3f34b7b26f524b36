"""PyTorch's own ScheduleDualPipeV (bench/torch_dualpipev.py) as an oracle: on 2 and 4 gloo ranks, n = 1 and
n = 4, its losses over two AdamW steps equal the single-process model's and its step-0 gradients equal that
model's by parameter name, every parameter having one (float64 on both sides, tensor-wise relative error
<= 1e-9). This checks the benchmark's peer computes the same thing as the project's runtime, so its step times
compare."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT, ROOT / "tests" / "pipeline"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from _pipeline_helpers import assert_grads_match, check_ok, tiny_config  # noqa: E402
from bench.torch_dualpipev import torch_dualpipev_worker  # noqa: E402  (importable by the spawned ranks)
from configs import parse_config  # noqa: E402
from rank_pool import launch  # noqa: E402
from pipeline.single_process import train_single_process  # noqa: E402

LOSS_TOL, GRAD_TOL, STEPS = 1e-9, 1e-9, 2
GRID = [(p, n) for p in (2, 4) for n in (1, 4)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("p,n", GRID, ids=[f"P{p}-n{n}" for p, n in GRID])
def test_torch_dualpipev_matches_reference(p, n):
    cfg_dict = tiny_config("dualpipev", p, n=n, steps=STEPS, dtype="float64")
    results = launch(torch_dualpipev_worker, p, (cfg_dict, STEPS, True), timeout_s=100)
    check_ok(results)
    want_losses, want_grads, params = train_single_process(parse_config(cfg_dict), steps=STEPS)

    for r in results:  # every rank saw the all-reduced loss
        got = [s["loss"] for s in r.value["stats"]]
        assert len(got) == STEPS
        for k, (g, w) in enumerate(zip(got, want_losses)):
            assert abs(g - w) <= LOSS_TOL * abs(w), f"rank {r.rank} step {k}: loss {g} vs reference {w}"
        assert all(s["step_time_s"] > 0 for s in r.value["stats"])

    got_grads: dict = {}
    for r in results:
        overlap = set(got_grads) & set(r.value["grads"])
        assert not overlap, f"DualPipeV holds each parameter once; duplicated: {sorted(overlap)[:3]}"
        got_grads.update(r.value["grads"])
    assert_grads_match(got_grads, want_grads, params, GRAD_TOL, f"P={p} n={n}")
