"""Every schedule on 4 gloo ranks equals the single-process model: the loss and every parameter gradient after one
step, then the losses of three AdamW steps. Two layouts: a pure pipeline (pp=4, dense) and pp=2 x dp=2 with the
MoE experts split over EP=2 (all-to-all dispatch/combine, data-parallel and expert-replica gradient
all-reduce, DualPipe's mirrored copies in the same all-reduce); n in {1, 4}, recompute off and on, F&B pairs
overlapped and serial.

Everything runs in float64 on both sides, so a different summation order (another layout, another CPU) moves a
result by ~1e-15 while a wrong result moves it by far more than the 1e-9 allowed; errors are tensor-wise,
||g - g_ref|| / ||g_ref||. Every parameter must have a gradient on both sides (none is skipped). Recompute must
not change a single bit of the gradients."""
from __future__ import annotations

import pytest

from _pipeline_helpers import assert_grads_match, check_ok, merged_grads, single_process_reference, tiny_config
from pipeline.launch.local import variants_worker
from rank_pool import launch

TOL = 1e-9
KINDS = ("gpipe", "1f1b", "zb1p", "dualpipe", "dualpipev")
LAYOUTS = {"pp4": dict(ranks=4), "pp2-dp2-ep2": dict(ranks=2, dp=2, ep=2, moe=True)}
GRID = [(kind, layout) for layout in LAYOUTS for kind in KINDS]
RECOMPUTE = ({"mode": "off"}, {"mode": "block", "block_size": 3})


def _variants(kind: str, layout: str) -> list[dict]:
    overlaps = (True, False) if kind in ("dualpipe", "dualpipev") else (True,)  # only DualPipe has F&B pairs
    return [tiny_config(kind, n=n, recompute=rc, overlap=ov, dtype="float64", **LAYOUTS[layout])
            for n in (1, 4) for rc in RECOMPUTE for ov in overlaps]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,layout", GRID, ids=[f"{k}-{lay}" for k, lay in GRID])
def test_schedule_matches_single_process(kind, layout):
    variants = _variants(kind, layout)
    results = launch(variants_worker, 4, (variants, True), timeout_s=280)
    check_ok(results)
    by_key = {}
    for vi, v in enumerate(variants):
        ref_key = (v["model"]["residual"]["n"], v["recompute"]["mode"])
        want_losses, want_grads, params = single_process_reference(v, v["train"]["steps"])
        got = merged_grads(results, vi)
        assert_grads_match(got, want_grads, params, TOL, f"{kind} {layout} variant {vi}")
        for r in results:  # every rank reports the global loss
            losses = [s["loss"] for s in r.value[vi]["stats"]]
            assert len(losses) == 3
            for step, (a, b) in enumerate(zip(losses, want_losses)):
                assert abs(a - b) <= TOL * abs(b), \
                    f"{kind} {layout} variant {vi} rank {r.rank}: step {step} loss {a} vs {b}"
        by_key[(ref_key, v["parallel"]["overlap"])] = got
    for n in (1, 4):  # recompute is exact: same bits as without it
        off, on = by_key[((n, "off"), True)], by_key[((n, "block"), True)]
        diff = [k for k in off if not off[k].equal(on[k])]
        assert not diff, f"recompute changed gradients of {diff[:3]}"


@pytest.mark.timeout(200)
def test_expert_parallel_pair_on_one_pipeline_rank_matches_single_process():
    """pp=1 x dp=2 x EP=2: both stages of the V on one rank, so each F&B pair's halves exchange tokens with the
    same peer at the same time; the forward's and the backward's all-to-alls must not pair up across halves
    (they did when both used one process group: gloo then failed on a size mismatch)."""
    variants = [tiny_config("dualpipev", 1, moe=True, dp=2, ep=2, blocks=4, dtype="float64", overlap=ov)
                for ov in (True, False)]
    results = launch(variants_worker, 2, (variants, True), timeout_s=180)
    check_ok(results)
    want_losses, want_grads, params = single_process_reference(variants[0], 3)
    for vi in range(len(variants)):
        assert_grads_match(merged_grads(results, vi), want_grads, params, TOL, f"variant {vi}")
        losses = [s["loss"] for s in results[0].value[vi]["stats"]]
        assert all(abs(a - b) <= TOL * abs(b) for a, b in zip(losses, want_losses)), (losses, want_losses)
