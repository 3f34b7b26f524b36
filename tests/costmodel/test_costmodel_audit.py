"""Issue 20, items 3 and 6: the Eq. 14-15 projection on TF32 tensor cores, activation memory that prices exactly
what the runtime keeps and recomputes, flat curve extrapolation reported, and single-pass mHC (`mhc-sp`)."""
import math

import pytest
import torch

from configs import eq20_block_size, load_config, parse_config, presets, recompute_block_size
from costmodel.physics.hardware import BUILTIN, Curve, CurveLookups, curve_warnings
from costmodel.physics.memory import rank_memory, stage_memory
from costmodel.physics.mhc_cost import (ResidualSpec, recompute_kernel, recompute_kernels, recompute_transient_elems,
                                residual_activation_elems, residual_kernels, stack_ends, stage_entry)
from costmodel.physics.ops import Shape
from costmodel.answers.predict import predict, residual_spec_of
from costmodel.pricing.pricer import Pricer
from costmodel.pricing.stage_split import resolve_layout
from costmodel.pricing.options import Options
from mhcpipe.cli import main
from schedules.build import build

GPUS = ("h800", "h100", "h200", "b200", "a100")
MODELS = ("paper-3b", "paper-9b", "paper-27b", "v4-flash", "v4-pro")


# ---- item 3a: Eq. 14-15 on TF32 tensor cores, bandwidth-bound -------------------------------------------
@pytest.mark.parametrize("gpu", GPUS)
def test_projection_is_tf32_tensor_core_and_bandwidth_bound(gpu):
    """mhc.proj, its backward and the single pass that contains it are priced at the tf32 peak with the matrix
    curve; at the presets' shapes their FLOPs take a fraction of their bytes' time on every built-in GPU, so
    the roofline is the memory term, below what the same FLOPs cost on FP32 CUDA cores (the audit's bug)."""
    hw = BUILTIN[gpu]
    for preset in MODELS:
        s = Shape.of(load_config(preset))
        for spec in (ResidualSpec("mhc", 4), ResidualSpec("mhc", 4, fused=False), ResidualSpec("mhc-sp", 4)):
            before, after, bwd = residual_kernels(spec, s.T, s.C, s.d, True, True)
            proj = [k for k in before + after + bwd + stage_entry(spec, s.T, s.C, s.d)[0]
                    if ".proj" in k.name or ".sp." in k.name]
            assert len(proj) >= 2, [k.name for k in before + after + bwd]
            for k in proj:
                assert (k.cls, k.dtype) == ("matrix", "tf32"), k
                compute = k.flops / (hw.peak_flops["tf32"] * hw.matrix_eff(k.flops / 1e9)) * 1e6
                assert compute < 0.6 * hw.memory_us(k.nbytes), (preset, k.name, compute, hw.memory_us(k.nbytes))
                assert hw.matmul_us(k.flops, k.nbytes, k.dtype) == hw.memory_us(k.nbytes)
                assert hw.matmul_us(k.flops, k.nbytes, k.dtype) <= hw.vector_us(k.flops, k.nbytes)


def test_tf32_falls_back_to_fp32_without_a_tf32_rate():
    cpu = BUILTIN["h800"].model_copy(update={"peak_flops": {"bf16": 1e11, "fp32": 5e10}})
    assert cpu.peak("tf32") == 5e10 and BUILTIN["h800"].peak("tf32") == 494.7e12


# ---- item 3b: activation memory = what the runtime keeps; never below the baseline --------------------------
def _runtime_variants():
    return [ResidualSpec.baseline(), ResidualSpec("mhc", 2), ResidualSpec("mhc", 4), ResidualSpec("mhc", 8),
            ResidualSpec("mhc", 4, fused=False), ResidualSpec("hc", 4), ResidualSpec("mhc-lite", 3),
            ResidualSpec("mhc-sp", 4), ResidualSpec("xhc", 16, 4)]


def test_residual_memory_never_below_the_baseline_and_zero_at_n1():
    """Per stage of L sub-layers, for every block size the runtime would use (the configured one, or Eq. 20
    with the variant's own n, the baseline's with n = 1): resident and transient residual-side memory of any
    variant is at least the plain residual's; a one-stream spec is the baseline and costs nothing extra."""
    C, d = 64, 2
    auto = load_config("tiny", {"recompute": {"mode": "auto"}}).recompute
    for L in range(1, 41):
        for spec in _runtime_variants():
            for mode in ["off", "auto"] + list(range(1, L + 3)):
                if mode == "off":
                    r_s = r_b = None
                elif mode == "auto":
                    r_s, r_b = recompute_block_size(auto, L, spec.n), recompute_block_size(auto, L, 1)
                else:
                    r_s = r_b = min(mode, L)
                mine = residual_activation_elems(spec, C, d, L, r_s)
                base = residual_activation_elems(ResidualSpec.baseline(), C, d, L, r_b)
                assert mine >= base, (spec.label(), L, mode, mine, base)
                if r_s:
                    assert recompute_transient_elems(spec, C, r_s) >= recompute_transient_elems(
                        ResidualSpec.baseline(), C, r_b), (spec.label(), L, mode)
        one = ResidualSpec("mhc", 1)
        assert one.is_baseline and residual_activation_elems(one, C, d, L, None) == 0.0


@pytest.mark.parametrize("preset", presets())
def test_rank_memory_never_below_the_baseline(preset):
    """The same on every preset's own layout, per rank (activations of the peak live chunks, the recompute
    transient, the receive buffers), for recompute off, auto and blocks 1..L+1."""
    cfg0 = load_config(preset)
    p = cfg0.parallel
    schedule = build(p.schedule, p.ranks, p.microbatches)
    layout = resolve_layout(cfg0, schedule, True)
    L = max(2 * len(blocks) for blocks, _, _ in layout.values())
    modes = [{"mode": "off"}, {"mode": "auto"}] + [{"mode": "block", "block_size": b} for b in range(1, L + 2)]
    for rc in modes:
        cfg = cfg0.model_copy(update={"recompute": cfg0.recompute.model_copy(update=rc)})
        per = {}
        for spec in (ResidualSpec.baseline(), ResidualSpec("mhc", 1), ResidualSpec("mhc", 2),
                     ResidualSpec("mhc", 4), ResidualSpec("mhc-sp", 4)):
            stages = {st: stage_memory(cfg, spec, st, *layout[st]) for st in layout}
            per[spec] = [rank_memory(cfg, spec, stages, schedule.stages_of(r), r, schedule.actions[r])
                         for r in range(schedule.num_ranks)]
        base = per[ResidualSpec.baseline()]
        assert [m.total_bytes for m in per[ResidualSpec("mhc", 1)]] == [m.total_bytes for m in base]
        for spec, ranks in per.items():
            for m, b in zip(ranks, base):
                assert m.activation_bytes >= b.activation_bytes and m.transient_bytes >= b.transient_bytes, \
                    (preset, rc, spec.label(), m, b)


T_RT, C_RT, BLOCKS_RT = 16, 32, 4  # the runtime stage below: tokens, hidden, blocks (8 sub-layers)


def _runtime_saved(n: int, rc_block: int | None):
    """Bytes the runtime's Stage keeps after one forward of a middle stage (its saved-tensor counter), and the
    bytes each recompute block rebuilds (its cache, without the block input's own storage)."""
    from pipeline.partition import StageSpec
    from pipeline.observability.recorder import Recorder
    from pipeline.runtime.saved_tensors import SavedTensors
    from pipeline.runtime.stage import ChunkRun, Stage, StageEnv

    cfg = parse_config(_runtime_cfg(n, rc_block))
    spec = StageSpec(stage=1, rank=0, pipeline=0, chunk=1, blocks=range(BLOCKS_RT), prev=0, next=2)
    stage = Stage(spec, cfg, store=None, dtype=torch.float32, rc_block=rc_block)
    saved = SavedTensors(stage.parameters())
    env = StageEnv(saved, Recorder(0, torch.device("cpu")), total_tokens=T_RT)
    x = torch.randn(T_RT, n, C_RT, generator=torch.Generator().manual_seed(3))
    run = ChunkRun(1, 0)
    for _ in stage.forward_steps(run, x, None, env):
        pass
    held = saved.live
    rebuilt = []
    blocks = [seg for seg in run.segs if seg[2] is not None]
    for (leaf, _, rec), group in zip(blocks, stage.groups):
        rec.rebuild()
        # the rebuilt storages; the plain residual's u_0 is a view of the block input, which is resident anyway
        x0 = leaf.untyped_storage().data_ptr()
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in rec._cache.values()}
        rebuilt.append((len(group), sum(b for ptr, b in storages.items() if ptr != x0)))
        rec.release()
    return held, rebuilt


def _runtime_cfg(n: int, rc_block: int | None) -> dict:
    return {"model": {"name": "audit", "vocab_size": 64, "num_blocks": BLOCKS_RT, "hidden": C_RT, "num_heads": 2,
                      "head_dim": 16, "mlp_hidden": 64,
                      "residual": {"variant": "mhc" if n > 1 else "residual", "n": n}},
            "parallel": {"schedule": "1f1b", "ranks": 2, "microbatches": 4, "microbatch_size": 2, "seq_len": 8},
            "recompute": {"mode": "block", "block_size": rc_block} if rc_block else {"mode": "off"},
            "train": {"dtype": "float32", "device": "cpu"}}


@pytest.mark.parametrize("n", [1, 4])
def test_memory_model_matches_what_the_runtime_keeps_and_rebuilds(n):
    """What recompute saves (kept bytes without it minus with it) and what each block rebuilds, measured on the
    runtime (pipeline.runtime.stage + pipeline.runtime.recompute: it drops x_l, H_pre x_l and F's norm output, keeps
    x_l0 and F's output), equal the cost model's numbers for the same stage, the plain residual included."""
    spec = ResidualSpec.baseline() if n == 1 else ResidualSpec("mhc", n)
    off, _ = _runtime_saved(n, None)
    for rc in (1, 3, 8):
        on, rebuilt = _runtime_saved(n, rc)
        cfgs = {r: parse_config(_runtime_cfg(n, r)) for r in (None, rc)}
        model = {r: stage_memory(cfgs[r], spec, 1, range(BLOCKS_RT), False, False, recompute=r is not None)
                 for r in (None, rc)}
        assert model[rc].recompute_block == rc
        assert off - on == model[None].chunk_activation_bytes - model[rc].chunk_activation_bytes, (n, rc)
        for length, nbytes in rebuilt:
            assert nbytes == recompute_transient_elems(spec, C_RT, length) * T_RT * 4, (n, rc, length)


def test_recompute_prices_every_rebuilt_norm():
    """Recompute drops F's norm output (and its input H_pre x_l), so each block's recompute re-runs one norm per
    sub-layer besides the residual-stream kernel, for the baseline too; the one-kernel form is their sum."""
    T, C, d = 4096, 2560, 2
    for spec in _runtime_variants():
        for r in (1, 2, 5):
            ks = recompute_kernels(spec, T, C, d, r)
            norms = [k for k in ks if k.name.endswith(".recompute.norm")]
            assert len(norms) == r and all(k.group == "recompute" for k in ks)
            assert sum(k.nbytes for k in ks) >= recompute_transient_elems(spec, C, r) * T * d
            one = recompute_kernel(spec, T, C, d, r)
            assert one.nbytes == sum(k.nbytes for k in ks) and one.launches == sum(k.launches for k in ks)


def test_baseline_recomputes_under_a_recompute_config(small_cfg):
    """The plain residual of a recompute config is priced as the runtime runs it: its own Eq. 20 blocks and
    their recompute kernels, no more activation memory than with recompute off (as much with blocks of one
    sub-layer: it then keeps F's output in place of the norm output it drops)."""
    p = small_cfg.parallel
    layout = resolve_layout(small_cfg, build(p.schedule, p.ranks, p.microbatches), False)
    base = ResidualSpec.baseline()
    on = Pricer(small_cfg, BUILTIN["h800"], base, layout, Options())
    off = Pricer(small_cfg, BUILTIN["h800"], base, layout, Options(), recompute=False)
    for st, (blocks, _, _) in layout.items():
        assert on.stage_mem[st].recompute_block == eq20_block_size(2 * len(blocks), 1)
        assert on.stage_mem[st].chunk_activation_bytes <= off.stage_mem[st].chunk_activation_bytes
        assert any(o.name.startswith("res.recompute") for o in on.backward_ops(st, with_w=False))
        assert not any("recompute" in o.name for o in off.backward_ops(st, with_w=False))


# ---- item 3c: flat extrapolation is reported ------------------------------------------------------------
def test_curve_coverage_and_one_warning_line_per_curve():
    h800 = BUILTIN["h800"]
    assert h800.memory_eff.coverage() == (0.0, 10_000.0)  # Calculon's 1..100 MB, trusted up to 10 GB
    assert Curve(unit="GFLOP", points=[(0, 1.0)]).coverage() == (0.0, math.inf)  # constant: never warns
    narrow = h800.model_copy(update={"memory_eff": Curve(unit="MB", points=[(1, 0.5), (10, 0.9)]),
                                     "matrix_eff": Curve(unit="GFLOP", points=[(0, 0.5), (2, 0.8)])})
    a, b = CurveLookups(narrow), CurveLookups(narrow)
    a.add("tiny.copy", "memory", 0, 0.25e6)        # below the first memory point (1 MB)
    a.add("big.gemm", "matrix", 5e9, 50e6)          # matrix beyond 2 GFLOP (coverage 2 x 2/2)
    a.add("huge.copy", "memory", 0, 200e6)          # beyond 100 MB (10 x 10/1), in two pricers
    b.add("huge.copy", "memory", 0, 300e6)
    b.add("huge.copy", "memory", 0, 500e6)
    b.add("fine.vec", "vector", 1e6, 5e6)           # inside every curve
    lines = curve_warnings([a, None, b])
    assert len(lines) == 2, lines
    mem = next(line for line in lines if " memory " in line)
    assert "tiny.copy" in mem and "0.25-0.25 MB" in mem and "huge.copy" in mem and "200-500 MB" in mem, mem
    assert "big.gemm" in next(line for line in lines if " matrix " in line)
    assert not any("fine.vec" in line for line in lines)
    assert curve_warnings([CurveLookups(narrow)]) == []


def test_prediction_reports_extrapolated_curves_once_each(small_cfg, monkeypatch):
    """With the Pricer recording its lookups (the hook: a CurveLookups per Pricer, `add` in kernel_us), a spec
    whose curves stop short gets one warning line per extrapolated curve over all its pricers, and the shipped
    h800 none."""
    p = small_cfg.parallel
    layout = resolve_layout(small_cfg, build(p.schedule, p.ranks, p.microbatches), False)
    if not hasattr(Pricer(small_cfg, BUILTIN["h800"], ResidualSpec.baseline(), layout, Options()), "curve_lookups"):
        init, price = Pricer.__init__, Pricer.kernel_us

        def hooked_init(self, *a, **kw):
            init(self, *a, **kw)
            self.curve_lookups = CurveLookups(self.hw)

        def hooked_price(self, k, backward):
            self.curve_lookups.add(k.name, k.cls, k.flops, k.nbytes)
            return price(self, k, backward)

        monkeypatch.setattr(Pricer, "__init__", hooked_init)
        monkeypatch.setattr(Pricer, "kernel_us", hooked_price)
    assert not any("efficiency curve" in w for w in predict(small_cfg, "h800", ladder=False).summary["warnings"])
    short = BUILTIN["h800"].model_copy(update={"name": "short", "memory_eff": Curve(unit="MB", points=[(2, 0.9)]),
                                               "matrix_eff": Curve(unit="GFLOP", points=[(0, 0.2), (1, 0.8)])})
    warns = [w for w in predict(small_cfg, short).summary["warnings"] if "efficiency curve" in w]
    assert len(warns) == 2 and sum(" memory " in w for w in warns) == 1 and sum(" matrix " in w for w in warns) == 1
    assert all("\n" not in w for w in warns)


# ---- item 6: single-pass mHC --------------------------------------------------------------------------------
def _per_c(kernels_of, T: int, d: int) -> float:
    """Elements per token and unit of C that kernels_of(C) move: the slope in C, so the O(n^2) fp32
    coefficients and Sinkhorn (independent of C) drop out exactly."""
    c1, c2 = 1024, 4096
    return (sum(k.nbytes for k in kernels_of(c2)) - sum(k.nbytes for k in kernels_of(c1))) / ((c2 - c1) * T * d)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_single_pass_moves_2n_plus_2_against_4n_plus_4(n):
    """Per sub-layer and token, residual side: mhc-sp's forward moves (2n+2)C and fused mhc's (4n+2)C, i.e.
    (4n+4)C with F's pre-norm (2C, priced with F for both); backward by the adjoint rule (3n+3)C against
    (9n+3)C; the stage entry (n+1)C forward."""
    T, d = 512, 2
    for v, fwd, bwd in (("mhc-sp", 2 * n + 2, 3 * n + 3), ("mhc", 4 * n + 2, 9 * n + 3)):
        spec = ResidualSpec(v, n)
        assert math.isclose(_per_c(lambda C: sum(residual_kernels(spec, T, C, d, True, True)[:2], []), T, d), fwd)
        assert math.isclose(_per_c(lambda C: residual_kernels(spec, T, C, d, True, True)[2], T, d), bwd)
    sp = ResidualSpec("mhc-sp", n)
    assert math.isclose(_per_c(lambda C: stage_entry(sp, T, C, d)[0], T, d), n + 1)
    assert math.isclose(_per_c(lambda C: stage_entry(sp, T, C, d)[1], T, d), 3 * n + 1)
    assert stage_entry(ResidualSpec("mhc", n), T, 64, d) == ([], [])
    assert stack_ends(sp, T, 64, d)[1] == []  # the head reads the last pass's u: no contract kernel


def test_single_pass_carried_state_and_boundary_buffers(small_cfg):
    sp, mhc = ResidualSpec("mhc-sp", 4), ResidualSpec("mhc", 4)
    assert (sp.carry_bytes, mhc.carry_bytes, ResidualSpec("mhc-sp", 1).carry_bytes) == (16, 0, 0)
    p = small_cfg.parallel
    schedule = build(p.schedule, p.ranks, p.microbatches)
    layout = resolve_layout(small_cfg, schedule, False)
    T, C, d = p.tokens_per_microbatch, small_cfg.model.hidden, 2
    mem = {}
    for spec in (sp, mhc):
        stages = {st: stage_memory(small_cfg, spec, st, *layout[st]) for st in layout}
        mem[spec] = rank_memory(small_cfg, spec, stages, schedule.stages_of(0), 0, schedule.actions[0])
    assert mem[sp].buffer_bytes - mem[mhc].buffer_bytes == 2 * len(schedule.stages_of(0)) * T * 16
    assert mem[sp].buffer_bytes == 2 * len(schedule.stages_of(0)) * T * (4 * C * d + 16)


def test_single_pass_is_predicted_and_cheaper_than_mhc(small_cfg):
    s = {v: predict(small_cfg, "h800", ResidualSpec(v, 4), ladder=False).summary for v in ("mhc", "mhc-sp")}
    assert 0 < s["mhc-sp"]["step_overhead_pct"] < s["mhc"]["step_overhead_pct"]
    assert s["mhc-sp"]["residual"] == "mhc-sp (n=4)"
    assert s["mhc-sp"]["memory_gib"]["mhc"] >= s["mhc-sp"]["memory_gib"]["baseline"]
    for kind in ("F", "I", "FB"):
        assert s["mhc-sp"]["op_us"]["mhc"][kind] < s["mhc"]["op_us"]["mhc"][kind]


def test_single_pass_cli_and_spec_errors(capsys):
    assert main(["predict", "--preset", "tiny", "--hardware", "h800", "--variant", "mhc-sp", "--n", "4"]) == 0
    assert "mhc-sp (n=4)" in capsys.readouterr().out
    assert main(["predict", "--preset", "tiny", "--variant", "mhc-sp", "--unfused"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--unfused" in err
    cfg = load_config("tiny")
    assert residual_spec_of(cfg, "mhc-sp", 4) == ResidualSpec("mhc-sp", 4, None, True, 20)
    assert residual_spec_of(cfg, "mhc-sp", 1).is_baseline


def test_xhc_is_priced_as_before():
    """xHC and xHC-Flash keep their anchors: forward I/O per sub-layer 73.5C and 51C at N = 16, k = 4 (arXiv
    2607.14530), mHC's unfused 34C at N = k = 4, twice that backward, all vector kernels."""
    T, d = 512, 2
    for N, k, fused, fwd in ((16, 4, False, 73.5), (16, 4, True, 51.0), (4, 4, False, 34.0)):
        spec = ResidualSpec("xhc", N, k, fused)
        assert math.isclose(_per_c(lambda C: sum(residual_kernels(spec, T, C, d, True, True)[:2], []), T, d), fwd)
        assert math.isclose(_per_c(lambda C: residual_kernels(spec, T, C, d, True, True)[2], T, d), 2 * fwd)
        assert all(kk.cls == "vector" for kk in sum(residual_kernels(spec, T, 64, d, True, True), []))
