"""xHC (N=16 streams, k=4 active) and single-pass mHC (mhc-sp, n=4) through the pipeline runtime on 4 gloo ranks
equal the single-process model: the loss and every parameter gradient after one step, then three AdamW steps'
losses, for DualPipeV (overlapped F&B pairs and serial) and 1F1B, recompute off and on; GPipe, ZB1P and DualPipe
once each.

What this guards beyond the per-module tests in tests/kernels: the stage boundary carries xHC's N*C state and
single-pass mHC's state packed with its carried coefficient (both directions: the coefficient's gradient goes
back), the embedding stage's entry coefficient and the head's contraction with the last coefficient sit on
different ranks, recompute rebuilds xHC's augmented write-back and single-pass mHC's delayed read bit for bit,
and xHC-Flash hands the attention's routing to the MLP inside a stage. float64 on both sides, tensor-wise
relative errors <= 1e-9 (a summation-order change moves them by ~1e-15)."""
from __future__ import annotations

import copy

import pytest

from _pipeline_helpers import assert_grads_match, check_ok, merged_grads, single_process_reference, tiny_config
from configs import parse_config
from pipeline.launch.local import variants_worker
from rank_pool import launch

TOL = 1e-9
RESIDUALS = {
    "xhc16-4": {"variant": "xhc", "n": 16, "active": 4, "aug_kernels": [2, 3]},
    "xhc16-4-flash": {"variant": "xhc", "n": 16, "active": 4, "aug_kernels": [2, 3], "flash": True},
    "mhc-sp4": {"variant": "mhc-sp", "n": 4},
}


def _config(kind: str, residual: dict, recompute: dict, overlap: bool) -> dict:
    cfg = tiny_config(kind, 4, recompute=recompute, overlap=overlap, dtype="float64")
    cfg["model"]["residual"] = copy.deepcopy(residual)
    return cfg


GRID = [(kind, name) for kind in ("dualpipev", "1f1b") for name in RESIDUALS]
OTHER_KINDS = ("gpipe", "zb1p", "dualpipe")  # every schedule: one variant each (recompute on, the default overlap)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,name", GRID, ids=[f"{k}-{n}" for k, n in GRID])
def test_wider_residual_matches_single_process(kind, name):
    residual = RESIDUALS[name]
    overlaps = (True, False) if kind == "dualpipev" else (True,)
    variants = [_config(kind, residual, rc, ov) for rc in ({"mode": "off"}, {"mode": "block", "block_size": 2})
                for ov in overlaps]
    results = launch(variants_worker, 4, (variants, True), timeout_s=280)
    check_ok(results)
    want_losses, want_grads, params = single_process_reference(variants[0], variants[0]["train"]["steps"])
    got_all = []
    for vi in range(len(variants)):
        got = merged_grads(results, vi)
        assert_grads_match(got, want_grads, params, TOL, f"{kind} {name} variant {vi}")
        for r in results:
            losses = [s["loss"] for s in r.value[vi]["stats"]]
            assert len(losses) == 3
            for step, (a, b) in enumerate(zip(losses, want_losses)):
                assert abs(a - b) <= TOL * abs(b), f"{kind} {name} variant {vi} rank {r.rank}: step {step} {a} vs {b}"
        got_all.append(got)
    off, on = got_all[0], got_all[len(overlaps)]  # recompute is exact: the same bits as without it
    diff = [k for k in off if not off[k].equal(on[k])]
    assert not diff, f"recompute changed gradients of {diff[:3]}"


@pytest.mark.parametrize("residual,dtype", [
    ({"variant": "mhc-sp", "n": 4}, "float32"), ({"variant": "mhc-sp", "n": 4}, "bfloat16"),
    ({"variant": "xhc", "n": 16, "active": 4}, "bfloat16"), ({"variant": "mhc", "n": 4}, "float32")])
def test_boundary_message_is_what_the_cost_model_prices(residual, dtype):
    """The runtime's P2P buffer per micro-batch (pipeline.runtime.train.boundary_width) has exactly the bytes the cost
    model sends: T x width x C x d plus mhc-sp's carried coefficient (ResidualSpec.carry_bytes per token)."""
    import torch

    from costmodel.physics import comm_cost as comm
    from costmodel.answers.predict import residual_spec_of
    from pipeline.model import activation_dtype
    from pipeline.runtime.train import boundary_width

    cfg_dict = tiny_config("1f1b", 4, dtype=dtype)
    cfg_dict["model"]["residual"] = residual
    cfg = parse_config(cfg_dict)
    spec = residual_spec_of(cfg)
    t, c = cfg.parallel.tokens_per_microbatch, cfg.model.hidden
    d = torch.empty((), dtype=activation_dtype(dtype)).element_size()
    runtime_bytes = t * cfg.model.residual.n * boundary_width(cfg) * d
    assert runtime_bytes == comm.boundary_bytes(t, spec.width, c, d) + t * spec.carry_bytes


def test_predict_prices_the_configs_own_residual():
    """`mhcpipe predict --config` of an xHC config prices that xHC: its k, and xHC-Flash only when the config
    runs Flash (the cost model's fused xHC form); mhc-sp keeps its single pass."""
    from costmodel.answers.predict import residual_spec_of

    def spec(residual):
        cfg_dict = tiny_config("1f1b", 4)
        cfg_dict["model"]["residual"] = residual
        return residual_spec_of(parse_config(cfg_dict))

    plain = spec({"variant": "xhc", "n": 16, "active": 3})
    assert (plain.variant, plain.n, plain.k, plain.fused) == ("xhc", 16, 3, False)
    assert spec({"variant": "xhc", "n": 16, "active": 3, "flash": True}).fused
    sp = spec({"variant": "mhc-sp", "n": 4})
    assert (sp.variant, sp.fused, sp.carry_bytes) == ("mhc-sp", True, 16)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", OTHER_KINDS)
def test_every_other_schedule_carries_the_wider_state(kind):
    """GPipe, ZB1P and DualPipe (two directions: the embedding with mhc-sp's entry coefficient and the head sit on
    two ranks each, their copies reduced as mirrored parameters) with xHC and mhc-sp, recompute in blocks of 2."""
    rc = {"mode": "block", "block_size": 2}
    for name in ("xhc16-4", "mhc-sp4"):
        variants = [_config(kind, RESIDUALS[name], rc, True)]
        results = launch(variants_worker, 4, (variants, True), timeout_s=280)
        check_ok(results)
        want_losses, want_grads, params = single_process_reference(variants[0], variants[0]["train"]["steps"])
        assert_grads_match(merged_grads(results, 0), want_grads, params, TOL, f"{kind} {name}")
        losses = [s["loss"] for s in results[0].value[0]["stats"]]
        assert all(abs(a - b) <= TOL * abs(b) for a, b in zip(losses, want_losses)), (kind, name, losses, want_losses)
