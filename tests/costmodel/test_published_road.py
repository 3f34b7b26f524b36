"""The road from the roofline to DeepSeek-V3's published 1,543 tokens/s per GPU (`predict --explain`): each rung
only slows, each factor computed by the model with its source, the rest stated as unexplained; and the honest
answer's FP8 axis."""
from __future__ import annotations

import dataclasses
import math

from configs import load_config
from costmodel.answers.honest import honest_variants
from costmodel.answers.predict import predict, residual_spec_of
from costmodel.answers.published_road import PUBLISHED, format_road, ramp_factor, road
from costmodel.physics.hardware import get_hardware
from costmodel.pricing.options import Options

H800 = get_hardware("h800")


def _predict(cfg):
    return predict(cfg, H800, options=Options(), ladder=False)


def test_v3_s_road_only_slows_and_ends_at_the_stated_ratio():
    v3 = load_config("deepseek-v3")
    r = road(v3, H800, Options(), _predict)
    pub = PUBLISHED["deepseek-v3"]
    assert round(pub.tokens_per_s_per_gpu) == 1543  # 14.8T tokens / 2,664K GPU hours
    values = [g.tokens_per_s_per_gpu for g in r.rungs]
    assert all(b <= a for a, b in zip(values, values[1:])), values
    s = _predict(v3).summary
    step = next(g for g in r.rungs if "predict's step" in g.name)
    assert math.isclose(step.tokens_per_s_per_gpu, s["tokens_per_s_per_gpu"]["baseline"])
    assert math.isclose(r.unexplained, values[-1] / pub.tokens_per_s_per_gpu)
    text = format_road(r)
    assert "unexplained" in text and "not published" in text and "§4.2" in text


def test_no_ramp_costs_nothing_and_a_config_without_a_published_run_has_no_road():
    v3 = load_config("deepseek-v3")
    step = _predict(v3).summary["iteration_us"]["baseline"]
    flat = dataclasses.replace(PUBLISHED["deepseek-v3"], ramp=(15360, 15360, 469e9))
    factor, _ = ramp_factor(v3, flat, _predict, step)
    assert math.isclose(factor, 1.0, rel_tol=1e-12)
    factor, _ = ramp_factor(v3, PUBLISHED["deepseek-v3"], _predict, step)
    assert 1.0 < factor < 1.05  # 3.2% of the tokens at smaller batches
    assert road(load_config("paper-27b"), H800, Options(), _predict) is None


def test_the_honest_answer_carries_the_other_gemm_precision():
    cfg = load_config("paper-27b")
    variants = honest_variants(cfg, residual_spec_of(cfg), Options())
    fp8 = [v for v in variants if v.precision == "FP8"]
    assert {v.hardware for v in fp8} == {"h800", "h200"} and len(fp8) == 2
    for v in fp8:  # the same assumption set in bf16 exists, and FP8's faster GEMMs change the overhead
        twin = next(w for w in variants if w.precision == "bf16" and (w.hardware, w.ep_layout, w.sigma, w.gemm,
                                                                      w.mhc_kernels, w.dispatcher)
                    == (v.hardware, v.ep_layout, v.sigma, v.gemm, v.mhc_kernels, v.dispatcher))
        assert abs(twin.fb_pct - v.fb_pct) > 0.5
