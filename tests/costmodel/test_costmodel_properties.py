"""Properties the cost model must satisfy (the issue's list) on small layouts."""
import math

import pytest

from costmodel.physics.mhc_cost import ResidualSpec
from costmodel.pricing.fb_overlap import overlap
from costmodel.answers.predict import Options, predict, residual_spec_of
from configs import eq20_block_size, eq20_objective, load_config, stage_blocks
from schedules import Durations, build
from schedules.formulas import bubble_formula


def test_n1_has_zero_overhead(small_cfg):
    for variant in ("mhc", "hc", "mhc-lite", "xhc"):
        spec = residual_spec_of(small_cfg, variant, 1, 1 if variant == "xhc" else None)
        assert spec.is_baseline, variant
        pred = predict(small_cfg, "h800", spec)
        assert pred.summary["step_overhead_pct"] == 0.0
        assert pred.mhc.makespan == pred.baseline.makespan
        assert pred.summary["memory_gib"]["mhc"] == pred.summary["memory_gib"]["baseline"]


@pytest.mark.parametrize("preset, overrides", [
    ("paper-3b", {"parallel": {"ranks": 4, "microbatches": 64, "expert_parallel": 8}}),
    ("paper-3b", {"parallel": {"ranks": 4, "microbatches": 64, "expert_parallel": 1}}),
    ("v4-flash", {"parallel": {"schedule": "1f1b"}})])
@pytest.mark.parametrize("variant", ["residual", "mhc"])
def test_full_backward_costs_at_least_its_parts(preset, overrides, variant):
    """B = I + W on the same streams: never shorter than I or W alone (the gradient flows along I; W only fills
    gaps), never longer than both back to back."""
    cfg = load_config(preset, overrides)
    pred = predict(cfg, "h800", residual_spec_of(cfg, variant, 1 if variant == "residual" else 4), ladder=False)
    pricer = pred.pricers["mhc"]
    for stage in pricer.layout:
        i, w, b = (overlap([chain], "streams", pricer.sigma, True).makespan for chain in (
            pricer.backward_ops(stage, with_w=False), pricer.backward_ops(stage, with_w=True, with_i=False),
            pricer.backward_ops(stage, with_w=True)))
        assert max(i, w) <= b * (1 + 1e-9) and b <= (i + w) * (1 + 1e-9), (stage, i, w, b)


def test_mhc_costs_time_and_traffic(small_cfg):
    s = predict(small_cfg, "h800", ladder=True).summary
    assert s["step_overhead_pct"] > 0
    assert s["boundary"]["bytes_mhc"] == 4 * s["boundary"]["bytes_baseline"]
    b = s["breakdown_pp"]
    assert math.isclose(sum(b.values()), s["step_overhead_pct"], rel_tol=1e-9, abs_tol=1e-9)


def test_more_p2p_bandwidth_less_exposed_comm(small_cfg):
    exposed, boundary = [], []
    for gbs in (2, 10, 50, 400):
        s = predict(small_cfg, "h800", options=Options(pp_bandwidth=gbs * 1e9), ladder=True).summary
        exposed.append(s["exposed_comm_us"]["mhc"])
        boundary.append(s["breakdown_pp"]["exposed_comm"])
    assert exposed == sorted(exposed, reverse=True) and exposed[0] > exposed[-1]
    assert boundary == sorted(boundary, reverse=True) and boundary[0] > boundary[-1]


def test_recompute_saves_memory_and_costs_time(small_cfg):
    def with_recompute(mode: str):
        return small_cfg.model_copy(update={"recompute": small_cfg.recompute.model_copy(update={"mode": mode})})

    on = predict(with_recompute("auto"), "h800", ladder=True)
    off = predict(with_recompute("off"), "h800", ladder=True)
    assert on.summary["memory_gib"]["mhc"] < off.summary["memory_gib"]["mhc"]
    assert on.mhc.makespan > off.mhc.makespan
    assert on.summary["breakdown_pp"]["recompute"] > 0 and off.summary["breakdown_pp"]["recompute"] == 0
    assert on.summary["memory_gib"]["mhc_no_recompute"] == off.summary["memory_gib"]["mhc"]


@pytest.mark.parametrize("variant", ["mhc", "xhc"])
def test_fused_is_faster_than_unfused(small_cfg, variant):
    k = 4 if variant == "xhc" else None
    n = 16 if variant == "xhc" else 4
    fused = predict(small_cfg, "h800", ResidualSpec(variant, n, k, fused=True), ladder=False)
    unfused = predict(small_cfg, "h800", ResidualSpec(variant, n, k, fused=False), ladder=False)
    assert fused.mhc.makespan < unfused.mhc.makespan
    for kind in ("F", "I", "FB"):
        assert fused.summary["op_us"]["mhc"][kind] < unfused.summary["op_us"]["mhc"][kind]


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("L", [1, 2, 5, 10, 24, 60])
def test_eq20_auto_minimises_within_the_stage(n, L):
    best = eq20_block_size(L, n)
    assert 1 <= best <= L
    assert eq20_objective(n, L, best) == min(eq20_objective(n, L, r) for r in range(1, L + 1))


def test_predict_chooses_eq20_block_for_each_stage():
    chosen = []
    for ranks, M in ((6, 24), (2, 8)):  # paper-27b's 30 blocks on 6 or 2 stages: 10 or 30 sub-layers per stage
        cfg = load_config("paper-27b", {"parallel": {"ranks": ranks, "microbatches": 8 * M}})
        L = 2 * len(stage_blocks(30, ranks)[0])
        chosen.append(predict(cfg, "h800", ladder=False).summary["recompute_block"])
        assert chosen[-1] == [eq20_block_size(L, 4)]
    assert chosen == [[2], [5]]


@pytest.mark.parametrize("kind, P, M", [("gpipe", 4, 8), ("dualpipe", 4, 8), ("dualpipe", 8, 20), ("dualpipev", 4, 10),
                                        ("1f1b", 4, 8), ("zb1p", 4, 12)])
def test_unit_cost_bubble_equals_schedule_formula(kind, P, M):
    blocks = 2 * P * 2 if kind == "dualpipev" else P * 2
    cfg = load_config("paper-3b", {"parallel": {"schedule": kind, "ranks": P, "microbatches": 8 * M},
                                   "model": {"num_blocks": blocks}})
    pred = predict(cfg, "h800", options=Options(unit_costs=True), ladder=False)
    _, expected = bubble_formula(build(kind, P, M), Durations(F=1, I=1, W=1))
    for sim in (pred.baseline, pred.mhc):
        assert set(sim.idle.values()) == {expected}


def test_xhc_is_priced(small_cfg):
    mhc = predict(small_cfg, "h800", ResidualSpec("mhc", 4), ladder=False).summary
    xhc = predict(small_cfg, "h800", ResidualSpec("xhc", 16, 4), ladder=False).summary
    assert xhc["boundary"]["bytes_mhc"] == 4 * mhc["boundary"]["bytes_mhc"]
    assert xhc["step_overhead_pct"] > mhc["step_overhead_pct"] > 0
    assert xhc["memory_gib"]["mhc"] > mhc["memory_gib"]["mhc"]


def test_hc_and_lite_variants(small_cfg):
    s = {v: predict(small_cfg, "h800", ResidualSpec(v, 4), ladder=False).summary["step_overhead_pct"]
         for v in ("hc", "mhc", "mhc-lite")}
    assert s["hc"] > s["mhc"] > 0 and s["mhc-lite"] > 0
    assert abs(s["mhc-lite"] - s["mhc"]) < 0.5 * s["mhc"]


def test_wider_model_smaller_overhead():
    """mHC bytes grow with C, block FLOPs with C^2 (costmodel.md §5): the overhead falls with width."""
    o = [predict(load_config(p), "h800", ladder=False).summary["fb_stage_overhead_pct"]
         for p in ("paper-3b", "paper-27b")]
    assert o[0] > o[1] > 0


def test_faster_hbm_lower_overhead():
    cfg = load_config("paper-27b")
    h800 = predict(cfg, "h800", ladder=False).summary["fb_stage_overhead_pct"]
    h200 = predict(cfg, "h200", ladder=False).summary["fb_stage_overhead_pct"]
    assert h200 < h800
