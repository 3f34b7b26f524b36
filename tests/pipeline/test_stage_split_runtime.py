"""An explicit stage split (parallel.stage_split, what `mhcpipe predict --split balanced` prints): the runtime cuts
the model so, and training stays the single-process model's (float64, tensor-wise 1e-9, as
test_pipeline_equivalence)."""
from __future__ import annotations

import pytest

from _pipeline_helpers import assert_grads_match, check_ok, merged_grads, single_process_reference, tiny_config
from configs import parse_config
from pipeline.launch.local import variants_worker
from pipeline.partition import plan_stages
from rank_pool import launch
from schedules import build

TOL = 1e-9


def _with_split(cfg: dict, cut: list[int]) -> dict:
    cfg["parallel"]["stage_split"] = cut
    return cfg


def test_the_runtime_plans_the_config_s_split():
    cfg = parse_config(_with_split(tiny_config("dualpipev", 2, blocks=8), [1, 3, 3, 1]))
    p = cfg.parallel
    specs = plan_stages(cfg, build(p.schedule, p.ranks, p.microbatches_per_replica))
    assert [list(s.blocks) for s in sorted(specs, key=lambda s: s.chunk)] == [[0], [1, 2, 3], [4, 5, 6], [7]]
    with pytest.raises(ValueError, match=r"parallel.stage_split=\[1, 3, 3\]: needs 4 entries"):
        parse_config(_with_split(tiny_config("dualpipev", 2, blocks=8), [1, 3, 3]))


@pytest.mark.timeout(300)
def test_an_uneven_split_trains_the_single_process_model():
    variants = [_with_split(tiny_config("1f1b", 4, blocks=8, dtype="float64"), [1, 3, 3, 1]),
                _with_split(tiny_config("dualpipev", 2, blocks=8, dtype="float64"), [3, 1, 1, 3])]
    results = launch(variants_worker, 4, ([variants[0]], True), timeout_s=280)
    check_ok(results)
    two = launch(variants_worker, 2, ([variants[1]], True), timeout_s=280)
    check_ok(two)
    for v, res in ((variants[0], results), (variants[1], two)):
        want_losses, want_grads, params = single_process_reference(v, 3)
        assert_grads_match(merged_grads(res, 0), want_grads, params, TOL, v["parallel"]["schedule"])
        losses = [s["loss"] for s in res[0].value[0]["stats"]]
        assert all(abs(a - b) <= TOL * abs(b) for a, b in zip(losses, want_losses)), (losses, want_losses)
