"""The fused kernels run with the GPU's launch configuration, on CPU under the Triton interpreter.

By default the interpreter launches its own tiles (one big program per test shape, no split-K, no multi-program
reductions), so the tile sizes, split counts and partial-sum reductions that the H200 runs are never executed
by CPU CI. Here `kernels.fused.use_config("gpu", num_sms=NUM_SMS)` forces the production choice
(`gpu_config`) with a small fake SM count, so that at a small shape
  - the projection forward splits K into several fp32 partial sums (split-K), the last slice ragged,
  - the projection backward splits the rows into several dphi partial sums (split-R),
  - the coefficient backward runs several programs, each writing its own dalpha/dbias partial sum,
  - the apply kernels use the GPU tiles BLOCK_T=2, BLOCK_C=256 with C > 256, so they walk C in two blocks.
Every kernel launch is recorded, and the test asserts those properties of the launches that really happened, so
it cannot silently fall back to the interpreter's tiles. On a CUDA machine the same tests run compiled.

TF32: the interpreter accepts tl.dot(..., input_precision="tf32") but computes every dot in full fp32
(triton 3.9 `InterpreterBuilder.create_dot` is a plain numpy matmul), so TF32 rounding would go untested. The
`tf32_emulated` fixture wraps create_dot to round fp32 operands of "tf32" dots to TF32 by truncating the 13 low
mantissa bits (the larger-error model of how tensor cores read fp32 registers; round-to-nearest halves it).
Under it, the bf16 projection's fp32 outputs show the TF32 error and the fp32 streams (which must use "ieee")
show none.

Errors are tensor-wise relative norms ||fused - ref|| / ||ref|| against the pure-PyTorch reference run in float64
on the same (already rounded) inputs, with random upstream gradients. Tolerances (measured in brackets: CPU
interpreter, this shape, TF32 emulated by truncation):
  - fp32 streams, every output and gradient: 1e-4 [<= 8e-7, dalpha].
  - bf16 streams: 1e-2, gpu.md §7's bf16 band, for every tensor that passes through a bf16 store [<= 6.6e-3,
    dscale]; 1e-3 for the fp32 coefficients h_pre/h_post/h_res, whose only error is TF32 [1.3-1.8e-4]. The
    interpreter truncates fp32 -> bf16 stores instead of rounding to nearest, which about doubles the store
    error compiled on CUDA.
  - the projection alone, its fp32 outputs (mix, dphi) for bf16 streams with TF32: at most 1e-3 and at least
    2e-5, so the TF32 rounding provably happened [4.1-4.3e-4 truncating, 2.0e-4 rounding to nearest, without
    TF32 2e-7]; sumsq (no dot) 1e-5 [5e-8]. The same bounds hold at K = n*C = 10,240, the C=2560 benchmark's
    width: the TF32 error of a random-sign sum grows like the sum itself, sqrt(K), so the relative error does
    not depend on K (bench/kernel_parity.py states the model).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import triton

from kernels import dispatch, reference
from kernels.config import MHCConfig
from kernels.parity import NAMES, parity_inputs, run_ops

F64 = torch.float64
NUM_SMS = 11  # fake SM count: with T=67, C=300, n=4 it gives split-K 5 (forward) and split-R 2 (backward)
T, N, C = 67, 4, 300  # T odd and C not a multiple of 256 or 128: ragged last tiles everywhere
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
TOL_BF16_COEFFS = 1e-3  # h_pre, h_post, h_res of bf16 streams: fp32 math on an exact input, TF32 the only error
KERNELS = ("project_fwd_kernel", "project_bwd_kernel", "coeffs_fwd_kernel", "coeffs_bwd_kernel", "pre_fwd_kernel",
           "pre_bwd_kernel", "post_res_fwd_kernel", "post_res_bwd_kernel")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().to(F64).cpu(), b.detach().to(F64).cpu()
    assert torch.isfinite(a).all(), "non-finite values in the fused result"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


class _Recorder:
    """Stands in for a @triton.jit kernel in kernels.fused: logs (name, grid, constexpr kwargs) and launches it."""

    def __init__(self, name, kernel, log):
        self.name, self.kernel, self.log = name, kernel, log

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.log.append((self.name, tuple(grid), dict(kwargs)))
            return launch(*args, **kwargs)

        return run


@pytest.fixture
def launches(monkeypatch, fused_device):
    import kernels.fused as fused

    log: list = []
    for name in KERNELS:
        monkeypatch.setattr(fused, name, _Recorder(name, getattr(fused, name), log))
    return log


@pytest.fixture
def tf32_emulated(fused_device, monkeypatch):
    """Make the interpreter's "tf32" dots round their fp32 operands to TF32 (truncation); CUDA has the real thing."""
    if fused_device == "cuda":
        return
    from triton.runtime import interpreter as ti

    builder = getattr(ti, "InterpreterBuilder", None)
    assert builder is not None and hasattr(builder, "create_dot"), (
        "triton's interpreter no longer has InterpreterBuilder.create_dot: update the TF32 emulation here")
    orig = builder.create_dot

    def to_tf32(h):
        if h.dtype != triton.language.float32:
            return h
        bits = np.ascontiguousarray(h.data, dtype=np.float32).view(np.uint32) & np.uint32(0xFFFFE000)
        return ti.TensorHandle(bits.view(np.float32), h.dtype)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if getattr(input_precision, "name", str(input_precision)).upper() == "TF32":
            a, b = to_tf32(a), to_tf32(b)
        return orig(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(builder, "create_dot", create_dot)


def _inputs(dtype, device, seed):
    return parity_inputs(T, N, C, dtype, device, seed)


def _check_launches(log, dtype):
    """The launches that ran are the GPU configuration's, with split > 1 and several programs."""
    import kernels.fused as fused

    gpu = fused.gpu_config(NUM_SMS)
    by = {}
    for name, grid, kw in log:
        by.setdefault(name, []).append((grid, kw))
    assert set(by) == set(KERNELS), f"kernels never launched: {set(KERNELS) - set(by)}"
    m = MHCConfig(n=N).num_mix

    fwd = gpu.project_fwd(T, N * C, m, dtype)
    assert fwd.split > 1 and fwd.per_split > fwd.block_k and (N * C) % fwd.per_split != 0  # several K blocks per
    for grid, kw in by["project_fwd_kernel"]:  # slice, last slice ragged
        assert grid == fwd.grid and grid[1] == fwd.split > 1, grid
        assert (kw["BLOCK_K"], kw["BLOCK_R"], kw["PRECISION"]) == (128, 32, fwd.precision)
    bwd = gpu.project_bwd(T, N * C, m, dtype)
    for grid, kw in by["project_bwd_kernel"]:
        assert grid == bwd.grid and grid[1] == bwd.split > 1, grid
        assert (kw["BLOCK_K"], kw["PRECISION"]) == (64, bwd.precision)
    assert {kw["HAS_PRE"] for _, kw in by["project_bwd_kernel"]} == {False, True}  # project and the pre side
    assert fwd.precision == ("tf32" if dtype == torch.bfloat16 else "ieee")

    for name in ("coeffs_fwd_kernel", "coeffs_bwd_kernel"):
        for grid, kw in by[name]:
            assert kw["BLOCK_T"] == 32 and grid == (triton.cdiv(T, 32),) and grid[0] > 1, (name, grid)

    for name in ("pre_fwd_kernel", "pre_bwd_kernel", "post_res_fwd_kernel", "post_res_bwd_kernel"):
        for grid, kw in by[name]:
            assert (kw["BLOCK_T"], kw["BLOCK_C"]) == (2, 256) and C > 256, (name, kw)
            want = (triton.cdiv(T, 2), triton.cdiv(C, 256)) if "fwd" in name else (triton.cdiv(T, 2),)
            assert grid == want, (name, grid)
    assert {kw["WRITE_DX"] for _, kw in by["pre_bwd_kernel"]} == {False, True}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_gpu_config_matches_reference(dtype, fused_device, launches, tf32_emulated):
    """Forward and every gradient of every fused op, separate and as the combined pre side, in the GPU config."""
    import kernels.fused as fused

    cfg, leaves, g = _inputs(dtype, fused_device, seed=18 + (dtype == torch.bfloat16))
    ref = run_ops(reference, [v.to(F64) for v in leaves], g.to(F64), cfg, combined=False)
    for combined in (False, True):
        with fused.use_config("gpu", num_sms=NUM_SMS):
            got = run_ops(fused, leaves, g, cfg, combined)
        errs = {k: rel(a, b) for k, a, b in zip(NAMES, got, ref)}
        tol = {k: TOL_BF16_COEFFS if dtype == torch.bfloat16 and k.startswith("h_") else TOL[dtype] for k in NAMES}
        bad = {k: f"{e:.2e} > {tol[k]}" for k, e in errs.items() if not e <= tol[k]}  # NaN never passes
        assert not bad, f"combined={combined}: {bad}"
    _check_launches(launches, dtype)


@pytest.mark.parametrize("k_width", [N * C, 10240], ids=["K1200", "K10240"])
def test_tf32_projection_gpu_config(k_width, fused_device, launches, tf32_emulated):
    """The projection of bf16 streams with the GPU's TF32 dots: its fp32 outputs carry the TF32 error and no more.

    mix = A @ phi and dphi = A^T dmix round phi / dmix to TF32 (bf16 A is exact in TF32); sumsq has no dot.
    At K = 10,240 (n*C of the C=2560 benchmark) the relative error stays the same size as at K = 1200."""
    import kernels.fused as fused

    rows, m = (T, 24) if k_width == N * C else (40, 24)
    gen = torch.Generator().manual_seed(k_width)
    x = torch.randn(rows, 1, k_width, generator=gen).to(torch.bfloat16).to(fused_device)
    phi = (torch.randn(k_width, m, generator=gen) / k_width**0.5).to(fused_device)
    dmix, dss = torch.randn(rows, m, generator=gen), torch.randn(rows, generator=gen)
    ref_x, ref_phi = x.to(F64).requires_grad_(), phi.to(F64).requires_grad_()
    ref = reference.project(ref_x, ref_phi)
    torch.autograd.backward(ref, [dmix.to(F64).to(fused_device), dss.to(F64).to(fused_device)])
    xs, ps = x.clone().requires_grad_(), phi.clone().requires_grad_()
    with fused.use_config("gpu", num_sms=NUM_SMS):
        mix, ss = fused.project(xs, ps)
    torch.autograd.backward((mix, ss), [dmix.to(fused_device), dss.to(fused_device)])

    e = {"mix": rel(mix, ref[0]), "dphi": rel(ps.grad, ref_phi.grad), "sumsq": rel(ss, ref[1])}
    assert 2e-5 <= e["mix"] <= 1e-3 and 2e-5 <= e["dphi"] <= 1e-3, e  # TF32-sized: rounded, but no worse
    assert e["sumsq"] <= 1e-5, e
    assert rel(xs.grad, ref_x.grad) <= 2e-2  # dA is stored in bf16
    (fgrid, fkw), = [(gr, kw) for name, gr, kw in launches if name == "project_fwd_kernel"]
    (bgrid, bkw), = [(gr, kw) for name, gr, kw in launches if name == "project_bwd_kernel"]
    assert fkw["PRECISION"] == bkw["PRECISION"] == "tf32" and fgrid[1] > 1, (fgrid, fkw)
    if k_width == N * C:
        assert bgrid[1] > 1, bgrid  # at K=10,240 the backward already has 160 K-programs, split 1


def test_fp32_streams_keep_ieee_dots(fused_device, tf32_emulated):
    """With TF32 emulated, fp32 streams still project at fp32 accuracy: the GPU config uses "ieee" for them."""
    import kernels.fused as fused

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(T, N, C, generator=gen).to(fused_device)
    phi = (torch.randn(N * C, 24, generator=gen) / (N * C) ** 0.5).to(fused_device)
    with fused.use_config("gpu", num_sms=NUM_SMS):
        mix, _ = fused.project(x, phi)
    assert rel(mix, reference.project(x.to(F64), phi.to(F64))[0]) <= 1e-5


def test_gpu_config_is_the_production_choice(fused_device):
    """Pinned H200 launches (132 SMs, T=4096, n=4): what the GPU ran before the configuration was made explicit."""
    import kernels.fused as fused

    h200 = fused.gpu_config(132)
    m = MHCConfig(n=4).num_mix
    # C: (forward split, per_split, backward split, per_split)
    pinned = {2560: (3, 3456, 2, 2048), 4096: (3, 5504, 2, 2048), 7168: (3, 9600, 1, 4096)}
    for c, (fs, fk, bs, br) in pinned.items():
        f = h200.project_fwd(4096, 4 * c, m, torch.bfloat16)
        b = h200.project_bwd(4096, 4 * c, m, torch.bfloat16)
        assert (f.block_r, f.block_k, f.block_m, f.split, f.per_split, f.precision) == (32, 128, 32, fs, fk, "tf32")
        assert (b.block_r, b.block_k, b.split, b.per_split, b.precision) == (32, 64, bs, br, "tf32")
        assert f.grid == (128, fs) and b.grid == (64 * c // 1024, bs)
        assert h200.project_fwd(4096, 4 * c, m, torch.float32).precision == "ieee"
        assert (h200.apply(c, 4).block_t, h200.apply(c, 4).block_c) == (2, 256)
    assert (h200.apply(64, 4).block_t, h200.apply(64, 4).block_c) == (4, 64)
    assert h200.coeffs(4096) == fused.CoeffTiles(32, 128)
    # hc projects T*n rows of width C: a wide R, so no split
    assert h200.project_fwd(4 * 4096, 2560, 6, torch.bfloat16).split == 1

    interp = fused.interpreter_config()
    assert interp.project_fwd(4096, 10240, m, torch.bfloat16).split == 1
    assert interp.project_bwd(4096, 10240, m, torch.bfloat16).split == 1
    assert interp.project_fwd(64, 1200, m, torch.bfloat16).precision == "ieee"
    assert (interp.apply(300, 4).block_t, interp.apply(300, 4).block_c) == (64, 512)
    assert interp.coeffs(67) == fused.CoeffTiles(128, 1)


def test_use_config_selects_and_restores(fused_device):
    import kernels.fused as fused

    dev = torch.device(fused_device)
    default = fused.launch_config(dev)
    assert default.kind == ("gpu" if fused_device == "cuda" else "interpreter")
    with fused.use_config("gpu", num_sms=7):
        assert fused.launch_config(dev) == fused.gpu_config(7)
        with fused.use_config("interpreter"):
            assert fused.launch_config(dev) == fused.interpreter_config()
        assert fused.launch_config(dev) == fused.gpu_config(7)
    assert fused.launch_config(dev) == default
    with pytest.raises(ValueError, match="num_sms"):
        with fused.use_config("gpu"):
            fused.launch_config(torch.device("cpu"))
    with pytest.raises(ValueError, match="kind"):
        with fused.use_config("tpu"):
            pass
    with pytest.raises(ValueError, match="num_sms"):
        fused.gpu_config(0)
    assert fused.launch_config(dev) == default


def test_backward_keeps_the_forward_config(fused_device, launches):
    """An autograd node launches its backward with the configuration chosen at its forward."""
    import kernels.fused as fused

    x = torch.randn(T, N, C, device=fused_device, requires_grad=True)
    h = torch.rand(T, N, device=fused_device, requires_grad=True)
    with fused.use_config("gpu", num_sms=NUM_SMS):
        out = fused.pre(x, h)
    out.backward(torch.randn_like(out))  # outside the context
    assert [(name, kw["BLOCK_T"], kw["BLOCK_C"]) for name, _, kw in launches] == [
        ("pre_fwd_kernel", 2, 256), ("pre_bwd_kernel", 2, 256)]
    ref = reference.pre(x.detach().to(F64), h.detach().to(F64))
    assert rel(out, ref) <= 1e-6


def test_dispatch_warns_once_when_interpreting_on_a_cuda_machine(fused_device, monkeypatch):
    """TRITON_INTERPRET with CUDA available: 'auto' would quietly run the eager ops on CUDA tensors (or the slow
    interpreter on CPU ones). resolve() warns, once per process; never without CUDA or without the variable."""
    from kernels import eager
    import types
    import warnings

    import kernels.fused as fused

    def resolve_warnings(backend, x):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # count our once-flag, not Python's per-location dedup
            got = dispatch.resolve(backend, x)
        return got, [w for w in caught
                     if issubclass(w.category, RuntimeWarning) and "TRITON_INTERPRET" in str(w.message)]

    x = torch.randn(2, 2, 8)
    monkeypatch.setattr(dispatch, "_warned_interpret_on_cuda", False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_warnings("auto", x)[1] == []  # no CUDA: the interpreter is the point
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    got, caught = resolve_warnings("auto", x)
    assert len(caught) == 1 and "eager" in str(caught[0].message), caught
    assert got is (fused if fused.INTERPRETED else eager)
    assert resolve_warnings("auto", x)[1] == []  # once per process
    if fused.INTERPRETED:
        assert resolve_warnings("fused", x)[1] == []

    monkeypatch.setattr(dispatch, "_warned_interpret_on_cuda", False)
    if fused.INTERPRETED:
        # The silent fallback itself: a CUDA tensor after kernels.fused was built for the interpreter.
        monkeypatch.delenv("TRITON_INTERPRET")
        cuda_like = types.SimpleNamespace(is_cuda=True, dtype=torch.float32)
        got, caught = resolve_warnings("auto", cuda_like)
        assert got is eager and len(caught) == 1 and "imported with TRITON_INTERPRET" in str(caught[0].message)
    else:
        monkeypatch.delenv("TRITON_INTERPRET")
        assert resolve_warnings("auto", x.to(fused_device))[1] == []  # compiled CUDA run: nothing to say
