"""Kernel rates from their own spec fields (costmodel/physics/hardware.py): FP8 GEMMs on `fp8_matrix_eff`
(DeepGEMM's table), the attention core's forward and backward on `attention_fwd_eff` / `attention_bwd_eff`
(FlashAttention-3's), the rest on `matrix_eff`; FP8 activation storage as its own switch; the combine's backward
in FP8 where DeepSeek-V3 sends it so."""
from __future__ import annotations

import math

from configs import load_config
from costmodel.answers.predict import predict
from costmodel.physics.hardware import GFLOP, Curve, get_hardware
from costmodel.physics.ops import Shape, attention, moe
from costmodel.pricing.options import Options

H800 = get_hardware("h800")


def _kernel(work, name):
    return next(k for k in (*work.F, *work.I, *work.W) if k.name == name)


def test_each_matrix_kernel_is_priced_on_its_own_curve():
    v3 = load_config("deepseek-v3")
    s = Shape.of(v3)
    att = attention(s)
    core, core_bwd = _kernel(att, "attn.core"), _kernel(att, "attn.core.bwd")
    gemm = _kernel(moe(s), "moe.experts")
    assert gemm.dtype == "fp8" and core.op == "attn_fwd" and core_bwd.op == "attn_bwd"

    def compute(k, curve, peak):
        return k.flops / (peak * curve(k.flops / GFLOP)) * 1e6

    assert math.isclose(H800.matmul_compute_us(gemm.flops, "fp8"),
                        compute(gemm, H800.fp8_matrix_eff, H800.peak_flops["fp8"]))
    assert math.isclose(H800.matmul_compute_us(core.flops, core.dtype, core.op),
                        compute(core, H800.attention_fwd_eff, H800.peak_flops["bf16"]))
    assert math.isclose(H800.matmul_compute_us(core_bwd.flops, core_bwd.dtype, core_bwd.op),
                        compute(core_bwd, H800.attention_bwd_eff, H800.peak_flops["bf16"]))
    # the published tops: DeepGEMM 1,297 of 1,978.9 FP8 TFLOP/s; FlashAttention-3 638 / 542 of 989.4
    assert math.isclose(max(e for _, e in H800.fp8_matrix_eff.points), 1297 / 1978.9)
    assert math.isclose(max(e for _, e in H800.attention_fwd_eff.points), 638 / 989.4)
    assert math.isclose(max(e for _, e in H800.attention_bwd_eff.points), 542 / 989.4)


def test_moving_one_ceiling_moves_only_its_kernels():
    """One shared ceiling (the bf16 GEMM curve for everything) fails this: raising matrix_eff must leave FP8 GEMMs
    and the attention core unchanged, and each own curve moves only its kernels."""
    s = Shape.of(load_config("deepseek-v3"))
    kernels = {k.name: k for w in (attention(s), moe(s)) for k in (*w.F, *w.I, *w.W) if k.cls == "matrix"}
    flat = Curve(unit="GFLOP", points=[(0, 1.0)])

    def times(hw):
        return {n: hw.matmul_compute_us(k.flops, k.dtype, k.op) for n, k in kernels.items()}

    before = times(H800)
    for field, moved in (("matrix_eff", {"moe.router", "moe.router.dgrad", "moe.router.wgrad"}),
                         ("fp8_matrix_eff", {n for n, k in kernels.items() if k.dtype == "fp8"}),
                         ("attention_fwd_eff", {"attn.core"}), ("attention_bwd_eff", {"attn.core.bwd"})):
        after = times(H800.model_copy(update={field: flat}))
        changed = {n for n in kernels if not math.isclose(after[n], before[n])}
        assert changed == moved, (field, sorted(changed ^ moved))


def test_a_spec_without_its_own_curves_falls_back_to_the_matrix_curve():
    a100 = get_hardware("a100")
    assert a100.fp8_matrix_eff is None and a100.attention_fwd_eff is None
    assert a100.matrix_curve(op="attn_bwd") is a100.matrix_eff


def test_fp8_storage_is_its_own_switch():
    """V3 with bf16 GEMMs but FP8 storage keeps V3's memory; FP8 GEMMs with bf16 storage keep the FP8 step."""
    v3 = load_config("deepseek-v3")
    runs = {}
    for fp8, storage in ((True, None), (False, None), (False, True), (True, False)):
        cfg = load_config("deepseek-v3", {"train": {"fp8": fp8, "fp8_storage": storage}})
        s = predict(cfg, H800, options=Options(), ladder=False).summary
        runs[(fp8, storage)] = (s["iteration_us"]["baseline"], s["memory_gib"]["baseline"])
    assert v3.train.fp8 and v3.train.fp8_activation_storage
    assert runs[(False, True)][1] == runs[(True, None)][1] < runs[(False, None)][1]  # memory follows storage
    assert runs[(True, False)][1] == runs[(False, None)][1]
    assert runs[(False, True)][0] == runs[(False, None)][0] > runs[(True, None)][0]  # time follows the GEMMs
    assert runs[(True, False)][0] == runs[(True, None)][0]


def test_the_combine_backward_is_sent_in_fp8_like_the_dispatch():
    s = Shape.of(load_config("deepseek-v3"))
    w = moe(s)
    by = {k.name: k.nbytes for k in (*w.F, *w.I) if k.cls == "a2a"}
    assert by["moe.combine.bwd"] == by["moe.dispatch"] < by["moe.combine"] == by["moe.dispatch.bwd"]
    bf16 = moe(Shape.of(load_config("deepseek-v3", {"train": {"fp8": False}})))
    by16 = {k.name: k.nbytes for k in (*bf16.F, *bf16.I) if k.cls == "a2a"}
    assert len(set(by16.values())) == 1
