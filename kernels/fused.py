"""Fused mHC ops: autograd Functions over the Triton kernels, with the signatures of kernels/reference.py.

Shape letters: T tokens, n streams, C hidden, m projection width. Streams may be fp32 or bf16 (fp32
accumulation inside); coefficients and parameters are fp32. Importing this module imports triton; kernels
whose JIT was built under TRITON_INTERPRET=1 run on CPU tensors (the CI path), otherwise on CUDA.

`mhc_pre_side` is the fused path the module uses for variant 'mhc': projection, coefficients and the pre
read in one autograd node, so its backward writes dx once (dmix @ phi^T + 2 x dsumsq + H_pre (x) dlin) in the
same pass that reduces dphi, instead of materialising separate [T, n, C] gradients.

Launch configuration: every tile size, split count and dot precision comes from one `LaunchConfig`, a pure
function of the shapes: `gpu_config(num_sms)` is what compiled CUDA runs (split-K projection forward and split-R
backward with fp32 partial sums reduced here, multi-program dalpha/dbias partial sums, 2x256 apply tiles, TF32
dots for bf16 streams), `interpreter_config()` what the Triton interpreter runs by default (one large tile per
test shape, no splits). `use_config("gpu", num_sms=...)` (tests and benchmarks only) makes the interpreter run
the GPU's choice; tests/kernels/test_kernels_gpu_config.py does.

Precision: for bf16 streams the three projection dots use TF32 (phi and dmix lose their 13 low mantissa bits;
bf16 x is exact in TF32). For random data that adds a relative error of 2e-4 (rounded to nearest) to 4e-4
(truncated) to mix, dphi and the fp32 coefficients, independent of K = n*C (error and value both grow as
sqrt(K)), so the bf16 tolerances at K = 10,240 are 1e-3 for H_pre/H_post/H_res and 1e-2 for every tensor
that passes through a bf16 store (those stores dominate, ~1.5e-3 each); fp32 streams use "ieee" dots and keep
1e-4. The derivation is in bench/kernel_parity.py. The interpreter accepts "tf32" but computes the dot in fp32.
"""
from __future__ import annotations

import contextlib
from dataclasses import astuple, dataclass
from typing import Literal

import torch
import triton

from . import reference
from .config import MHCConfig
from .triton_apply import post_res_bwd_kernel, post_res_fwd_kernel, pre_bwd_kernel, pre_fwd_kernel
from .triton_coeffs import coeffs_bwd_kernel, coeffs_fwd_kernel
from .triton_project import project_bwd_kernel, project_fwd_kernel

# Whether the @triton.jit functions above were built for the interpreter (decided at decoration time).
INTERPRETED: bool = type(pre_fwd_kernel).__name__ == "InterpretedFunction"
_STREAM_DTYPES = (torch.float32, torch.bfloat16)


def _np2(v: int) -> int:
    return triton.next_power_of_2(max(int(v), 1))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def _check_stream(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dtype not in _STREAM_DTYPES:
        raise ValueError(f"{name} has dtype {x.dtype}; the fused kernels take fp32 or bf16 (use the reference "
                         "backend for fp64)")
    return x.contiguous()


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32).contiguous()


# ---------------------------------------------------------------- launch configuration (tiles, splits, precision)
@dataclass(frozen=True)
class ProjectTiles:
    """One launch of a projection kernel. Grid = (grid[0], split): the forward splits K into `split` slices of
    `per_split` columns, the backward splits R into `split` slices of `per_split` rows; each slice writes its own
    fp32 partial sum (mix/sumsq forward, dphi backward) and the caller reduces them (deterministic, no atomics)."""

    block_r: int
    block_k: int
    block_m: int
    split: int
    per_split: int
    precision: str  # tl.dot input_precision: "tf32" (bf16 streams on GPU) or "ieee"
    grid: tuple[int, int]


@dataclass(frozen=True)
class ApplyTiles:
    """Pre read / post+res write: each program owns block_t tokens and block_c channels (forward grid
    [cdiv(T, block_t), cdiv(C, block_c)]; the backward walks C in block_c steps, grid [cdiv(T, block_t)])."""

    block_t: int
    block_c: int


@dataclass(frozen=True)
class CoeffTiles:
    """Coefficient kernels: block_t tokens per program; the backward writes one dalpha/dbias partial sum per
    program (`grid` of them), reduced by the caller."""

    block_t: int
    grid: int


@dataclass(frozen=True)
class LaunchConfig:
    """Every tile size, split count and dot precision of the fused kernels, as pure functions of the shapes.

    kind "gpu" is the production choice (`gpu_config(num_sms)`): split-K projection forward and split-R
    backward sized to fill 2 programs per SM, TF32 dots for bf16 streams, 1024-element apply tiles, 32-token
    coefficient programs. kind "interpreter" (`interpreter_config()`) is what the Triton interpreter runs by
    default: it pays per program and per op, not per element, so it gets one large tile per test shape and no
    splits. Tests and benchmarks run the GPU choice under the interpreter with `use_config("gpu", num_sms=...)`.
    """

    kind: Literal["gpu", "interpreter"]
    num_sms: int = 1

    def __post_init__(self):
        if self.kind not in ("gpu", "interpreter"):
            raise ValueError(f"LaunchConfig kind={self.kind!r} is unknown; choose 'gpu' or 'interpreter'")
        if int(self.num_sms) < 1:
            raise ValueError(f"num_sms={self.num_sms} must be >= 1")

    @property
    def gpu(self) -> bool:
        return self.kind == "gpu"

    def precision(self, dtype: torch.dtype) -> str:
        # mhc.md §2.2 pins a TF32 projection for bf16 streams; fp32 streams keep full precision. The Triton
        # interpreter accepts "tf32" but computes the dot in full fp32 (it does not round the operands).
        return "tf32" if (self.gpu and dtype == torch.bfloat16) else "ieee"

    def _split(self, length: int, block: int, other_programs: int) -> tuple[int, int]:
        """(slices, elements per slice) of a reduction over `length` in `block`-sized blocks, beside
        `other_programs` programs: on the GPU enough slices for 2 programs per SM, one under the interpreter."""
        blocks = triton.cdiv(length, block)
        split = max(1, min(blocks, triton.cdiv(2 * self.num_sms, other_programs))) if self.gpu else 1
        per_split = triton.cdiv(blocks, split) * block
        return triton.cdiv(length, per_split), per_split

    def project_fwd(self, r: int, k: int, m: int, dtype: torch.dtype) -> ProjectTiles:
        """mix = A[r, k] @ phi[k, m]: split K so a short T still fills the GPU."""
        block_r, block_m = 32, max(16, _np2(m))
        block_k = 128 if self.gpu else 256
        grid_r = triton.cdiv(r, block_r)
        split, per_split = self._split(k, block_k, grid_r)
        return ProjectTiles(block_r, block_k, block_m, split, per_split, self.precision(dtype), (grid_r, split))

    def project_bwd(self, r: int, k: int, m: int, dtype: torch.dtype) -> ProjectTiles:
        """dA and dphi = A^T dmix: programs over K blocks, rows split so a narrow K still fills the GPU."""
        block_r, block_m = 32, max(16, _np2(m))
        block_k = 64 if self.gpu else 256
        k_blocks = triton.cdiv(k, block_k)
        split, per_split = self._split(r, block_r, k_blocks)
        return ProjectTiles(block_r, block_k, block_m, split, per_split, self.precision(dtype), (k_blocks, split))

    def apply(self, c: int, n: int) -> ApplyTiles:
        np_ = _np2(n)
        if not self.gpu:
            return ApplyTiles(64, min(_np2(c), 512))
        block_c = min(_np2(c), 256)
        return ApplyTiles(max(2, 1024 // (np_ * block_c)), block_c)

    def coeffs(self, t: int) -> CoeffTiles:
        # The interpreter's cost is per program and op, so one program covers all tokens of a test shape.
        block_t = 32 if self.gpu else min(512, max(16, _np2(t)))
        return CoeffTiles(block_t, triton.cdiv(t, block_t))


def gpu_config(num_sms: int) -> LaunchConfig:
    """The production (compiled) choice for a device with num_sms streaming multiprocessors (H200: 132)."""
    return LaunchConfig("gpu", int(num_sms))


def interpreter_config() -> LaunchConfig:
    """The Triton interpreter's default: large tiles, no splits, full-precision dots."""
    return LaunchConfig("interpreter")


# Test/benchmark override set by use_config: None, or (kind, num_sms or None = the device's SM count).
# A plain module global, not a ContextVar: autograd runs CUDA backward nodes on its own worker thread.
_OVERRIDE: tuple[str, int | None] | None = None


@contextlib.contextmanager
def use_config(kind: Literal["gpu", "interpreter"], num_sms: int | None = None):
    """Tests and benchmarks only: launch the fused ops with the "gpu" or "interpreter" choice whatever runs
    them, e.g. `with use_config("gpu", num_sms=16):` runs the exact GPU tiles, split-K/split-R partial sums and
    multi-program dalpha/dbias reductions under the interpreter (a small fake SM count makes split > 1 happen
    at small shapes). num_sms=None takes the device's SM count (CUDA tensors only). An autograd node keeps the
    choice made at its forward for its backward. Process-wide while active: not for concurrent use."""
    global _OVERRIDE
    LaunchConfig(kind, 1 if num_sms is None else num_sms)  # validate now, not at the first launch
    prev, _OVERRIDE = _OVERRIDE, (kind, None if num_sms is None else int(num_sms))
    try:
        yield
    finally:
        _OVERRIDE = prev


def launch_config(device: torch.device) -> LaunchConfig:
    """The configuration the fused ops launch with on `device`: the use_config override when one is active,
    else the interpreter's choice when the kernels were built for the interpreter, else gpu_config(SM count)."""
    if _OVERRIDE is None:
        return interpreter_config() if INTERPRETED else gpu_config(_num_sms(device))
    kind, sms = _OVERRIDE
    if kind == "interpreter":
        return interpreter_config()
    if sms is None:
        if device.type != "cuda":
            raise ValueError("use_config('gpu') on a non-CUDA tensor needs num_sms= (there is no SM count to read)")
        sms = _num_sms(device)
    return gpu_config(sms)


# ---------------------------------------------------------------- kernel 1: projection + sum of squares
def _project_fwd(a: torch.Tensor, w: torch.Tensor, launch: LaunchConfig | None = None):
    """(mix [r, m], sumsq [r]) fp32 for A [r, k] (stream dtype) and phi [k, m] fp32."""
    r, k = a.shape
    m = w.shape[1]
    tiles = (launch or launch_config(a.device)).project_fwd(r, k, m, a.dtype)
    mix = torch.empty(tiles.split, r, m, device=a.device, dtype=torch.float32)
    ss = torch.empty(tiles.split, r, device=a.device, dtype=torch.float32)
    project_fwd_kernel[tiles.grid](a, w, mix, ss, r, k, m, tiles.per_split, BLOCK_R=tiles.block_r, BLOCK_K=tiles.block_k,
                                 BLOCK_M=tiles.block_m, PRECISION=tiles.precision)
    return (mix[0], ss[0]) if tiles.split == 1 else (mix.sum(0), ss.sum(0))


def _project_bwd(a, w, dmix, dss, h_pre=None, dlin=None, n=1, c=1, launch: LaunchConfig | None = None):
    """(dA [r, k] in A's dtype, dphi [k, m] fp32); with h_pre/dlin, dA also carries the pre read's dx."""
    r, k = a.shape
    m = w.shape[1]
    tiles = (launch or launch_config(a.device)).project_bwd(r, k, m, a.dtype)
    da = torch.empty_like(a)
    dw = torch.empty(tiles.split, k, m, device=a.device, dtype=torch.float32)
    has_pre = h_pre is not None
    project_bwd_kernel[tiles.grid](
        a, w, dmix, dss, h_pre if has_pre else dss, dlin if has_pre else dss, da, dw, r, k, m, c, tiles.per_split,
        N=n, HAS_PRE=has_pre, BLOCK_R=tiles.block_r, BLOCK_K=tiles.block_k, BLOCK_M=tiles.block_m,
        PRECISION=tiles.precision)
    return da, dw.sum(0)


def _zeros_if_none(g, like_shape, device):
    return torch.zeros(like_shape, device=device, dtype=torch.float32) if g is None else _f32(g)


class _Project(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, phi):
        t, n, c = x.shape
        a = _check_stream(x, "x").view(t, n * c)
        w = _f32(phi)
        ctx.launch = launch_config(a.device)
        mix, ss = _project_fwd(a, w, ctx.launch)
        ctx.save_for_backward(a, w)
        ctx.meta = (x.shape, phi.dtype)
        return mix, ss

    @staticmethod
    def backward(ctx, dmix, dss):
        a, w = ctx.saved_tensors
        shape, phi_dtype = ctx.meta
        dmix = _zeros_if_none(dmix, (a.shape[0], w.shape[1]), a.device)
        dss = _zeros_if_none(dss, (a.shape[0],), a.device)
        da, dw = _project_bwd(a, w, dmix, dss, launch=ctx.launch)
        return da.view(shape), dw.to(phi_dtype)


def project(x: torch.Tensor, phi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused kernel 1; same contract as reference.project."""
    reference._check_x(x)
    if phi.dim() != 2 or phi.shape[0] != x.shape[1] * x.shape[2]:
        raise ValueError(f"phi must be [n*C, m] = [{x.shape[1] * x.shape[2]}, m], got {tuple(phi.shape)}")
    return _Project.apply(x, phi)


# ---------------------------------------------------------------- kernels 2+3: coefficients + Sinkhorn
def _coeff_consts(cfg: MHCConfig, width: int):
    soft = cfg.sinkhorn_form == "softmax"
    return dict(inv_width=1.0 / width, rms_eps=cfg.rms_eps, EPS_DIV=cfg.eps if soft else 0.0,
                EPS_ADD=cfg.eps if soft else 0.0), (cfg.eps if soft else 0.0)


def _coeffs_fwd(mix, ss, alpha, bias, cfg, width, launch: LaunchConfig | None = None):
    t, n = mix.shape[0], cfg.n
    h_pre = torch.empty(t, n, device=mix.device, dtype=torch.float32)
    h_post = torch.empty_like(h_pre)
    h_res = torch.empty(t, n, n, device=mix.device, dtype=torch.float32)
    consts, pre_eps = _coeff_consts(cfg, width)
    tiles = (launch or launch_config(mix.device)).coeffs(t)
    coeffs_fwd_kernel[(tiles.grid,)](
        mix, ss, alpha, bias, h_pre, h_post, h_res, t, consts["inv_width"], consts["rms_eps"], pre_eps,
        consts["EPS_DIV"], consts["EPS_ADD"], N=n, NP=_np2(n), ITERS=cfg.sinkhorn_iters, BLOCK_T=tiles.block_t)
    return h_pre, h_post, h_res


def _coeffs_bwd(mix, ss, alpha, bias, dh_pre, dh_post, dh_res, cfg, width, launch: LaunchConfig | None = None):
    t, n, m = mix.shape[0], cfg.n, mix.shape[1]
    tiles = (launch or launch_config(mix.device)).coeffs(t)
    grid = tiles.grid
    dmix = torch.empty_like(mix)
    dss = torch.empty_like(ss)
    dalpha = torch.empty(grid, 3, device=mix.device, dtype=torch.float32)
    dbias = torch.empty(grid, m, device=mix.device, dtype=torch.float32)
    consts, _ = _coeff_consts(cfg, width)
    coeffs_bwd_kernel[(grid,)](
        mix, ss, alpha, bias, dh_pre, dh_post, dh_res, dmix, dss, dalpha, dbias, t, consts["inv_width"],
        consts["rms_eps"], consts["EPS_DIV"], consts["EPS_ADD"], N=n, NP=_np2(n), ITERS=cfg.sinkhorn_iters,
        BLOCK_T=tiles.block_t)
    return dmix, dss, dalpha.sum(0), dbias.sum(0)


class _Coefficients(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mix, ss, alpha, bias, cfg, width):
        args = (_f32(mix), _f32(ss), _f32(alpha), _f32(bias))
        ctx.save_for_backward(*args)
        ctx.meta = (cfg, width, alpha.dtype, bias.dtype)
        ctx.launch = launch_config(mix.device)
        return _coeffs_fwd(*args, cfg, width, ctx.launch)

    @staticmethod
    def backward(ctx, dh_pre, dh_post, dh_res):
        mix, ss, alpha, bias = ctx.saved_tensors
        cfg, width, a_dt, b_dt = ctx.meta
        t, n = mix.shape[0], cfg.n
        dh_pre = _zeros_if_none(dh_pre, (t, n), mix.device)
        dh_post = _zeros_if_none(dh_post, (t, n), mix.device)
        dh_res = _zeros_if_none(dh_res, (t, n, n), mix.device)
        dmix, dss, dalpha, dbias = _coeffs_bwd(mix, ss, alpha, bias, dh_pre, dh_post, dh_res, cfg, width,
                                               ctx.launch)
        return dmix, dss, dalpha.to(a_dt), dbias.to(b_dt), None, None


def coefficients(mix, sumsq, alpha, bias, cfg: MHCConfig, width: int):
    """Fused kernels 2+3 for 'mhc'. 'hc' and 'mhc-lite' have no iteration to fuse: their O(n^2)-per-token
    coefficient math runs as the reference (plain autograd), on top of the fused projection."""
    if cfg.variant != "mhc":
        return reference.coefficients(mix, sumsq, alpha, bias, cfg, width)
    if mix.dim() != 2 or mix.shape[1] != cfg.num_mix:
        raise ValueError(f"mix must be [T, {cfg.num_mix}] for variant='mhc', got {tuple(mix.shape)}")
    if alpha.shape != (3,) or bias.shape != (cfg.num_mix,):
        raise ValueError(f"alpha must be [3] and bias [{cfg.num_mix}], got {tuple(alpha.shape)}, {tuple(bias.shape)}")
    return _Coefficients.apply(mix, sumsq, alpha, bias, cfg, width)


# ---------------------------------------------------------------- kernel 4: pre read
def _pre_fwd(x, h_pre, launch: LaunchConfig | None = None):
    t, n, c = x.shape
    block_t, block_c = astuple((launch or launch_config(x.device)).apply(c, n))
    out = torch.empty(t, c, device=x.device, dtype=x.dtype)
    pre_fwd_kernel[(triton.cdiv(t, block_t), triton.cdiv(c, block_c))](
        x, h_pre, out, t, c, N=n, NP=_np2(n), BLOCK_T=block_t, BLOCK_C=block_c)
    return out


def _pre_bwd(x, h_pre, dout, write_dx: bool, launch: LaunchConfig | None = None):
    t, n, c = x.shape
    block_t, block_c = astuple((launch or launch_config(x.device)).apply(c, n))
    dh = torch.empty(t, n, device=x.device, dtype=torch.float32)
    dx = torch.empty_like(x) if write_dx else dh
    pre_bwd_kernel[(triton.cdiv(t, block_t),)](x, h_pre, dout, dx, dh, t, c, N=n, NP=_np2(n), WRITE_DX=write_dx,
                                               BLOCK_T=block_t, BLOCK_C=block_c)
    return (dx if write_dx else None), dh


class _Pre(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, h_pre):
        x = _check_stream(x, "x")
        h = _f32(h_pre)
        ctx.save_for_backward(x, h)
        ctx.h_dtype = h_pre.dtype
        ctx.launch = launch_config(x.device)
        return _pre_fwd(x, h, ctx.launch)

    @staticmethod
    def backward(ctx, dout):
        x, h = ctx.saved_tensors
        dx, dh = _pre_bwd(x, h, dout.contiguous(), True, ctx.launch)
        return dx, dh.to(ctx.h_dtype)


def pre(x: torch.Tensor, h_pre: torch.Tensor) -> torch.Tensor:
    """Fused kernel 4; same contract as reference.pre."""
    reference._check_x(x)
    if h_pre.shape != x.shape[:2]:
        raise ValueError(f"h_pre must be [T, n] = {tuple(x.shape[:2])}, got {tuple(h_pre.shape)}")
    return _Pre.apply(x, h_pre)


# ---------------------------------------------------------------- kernel 5: post + res write
class _PostRes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, h_post, h_res):
        x = _check_stream(x, "x")
        y = y.to(x.dtype).contiguous()
        hp, hr = _f32(h_post), _f32(h_res)
        t, n, c = x.shape
        ctx.launch = launch_config(x.device)
        block_t, block_c = astuple(ctx.launch.apply(c, n))
        out = torch.empty_like(x)
        post_res_fwd_kernel[(triton.cdiv(t, block_t), triton.cdiv(c, block_c))](
            x, y, hp, hr, out, t, c, N=n, NP=_np2(n), BLOCK_T=block_t, BLOCK_C=block_c)
        ctx.save_for_backward(x, y, hp, hr)
        ctx.dtypes = (h_post.dtype, h_res.dtype)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, y, hp, hr = ctx.saved_tensors
        t, n, c = x.shape
        dout = dout.to(x.dtype).contiguous()
        # bench/kernel_bench.py times this backward on a stand-in ctx without `launch`: then the current choice.
        launch = getattr(ctx, "launch", None) or launch_config(x.device)
        block_t, block_c = astuple(launch.apply(c, n))
        dx, dy = torch.empty_like(x), torch.empty_like(y)
        dhp, dhr = torch.empty_like(hp), torch.empty_like(hr)
        post_res_bwd_kernel[(triton.cdiv(t, block_t),)](
            x, y, hp, hr, dout, dx, dy, dhp, dhr, t, c, N=n, NP=_np2(n), BLOCK_T=block_t, BLOCK_C=block_c)
        hp_dt, hr_dt = ctx.dtypes
        return dx, dy, dhp.to(hp_dt), dhr.to(hr_dt)


def post_res(x: torch.Tensor, y: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor) -> torch.Tensor:
    """Fused kernel 5; same contract as reference.post_res."""
    reference._check_x(x)
    t, n, c = x.shape
    if y.shape != (t, c):
        raise ValueError(f"y (the sub-layer output) must be [T, C] = [{t}, {c}], got {tuple(y.shape)}")
    if h_post.shape != (t, n) or h_res.shape != (t, n, n):
        raise ValueError(f"h_post must be [T, n] and h_res [T, n, n], got {tuple(h_post.shape)}, {tuple(h_res.shape)}")
    return _PostRes.apply(x, y, h_post, h_res)


# ---------------------------------------------------------------- the sub-layer's pre side in one node
class _MHCPreSide(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, phi, alpha, bias, cfg):
        x = _check_stream(x, "x")
        t, n, c = x.shape
        a = x.view(t, n * c)
        w, al, b = _f32(phi), _f32(alpha), _f32(bias)
        ctx.launch = launch = launch_config(x.device)
        mix, ss = _project_fwd(a, w, launch)
        h_pre, h_post, h_res = _coeffs_fwd(mix, ss, al, b, cfg, n * c, launch)
        lin = _pre_fwd(x, h_pre, launch)
        ctx.save_for_backward(x, w, al, b, mix, ss, h_pre)
        ctx.meta = (cfg, phi.dtype, alpha.dtype, bias.dtype)
        return lin, h_pre, h_post, h_res

    @staticmethod
    def backward(ctx, dlin, dh_pre_out, dh_post, dh_res):
        x, w, al, b, mix, ss, h_pre = ctx.saved_tensors
        cfg, phi_dt, a_dt, b_dt = ctx.meta
        t, n, c = x.shape
        dev = x.device
        if dlin is None:
            dlin = torch.zeros(t, c, device=dev, dtype=x.dtype)
        dlin = dlin.to(x.dtype).contiguous()
        launch = ctx.launch
        _, dh_pre = _pre_bwd(x, h_pre, dlin, write_dx=False, launch=launch)
        if dh_pre_out is not None:
            dh_pre = dh_pre + dh_pre_out.float()
        dh_post = _zeros_if_none(dh_post, (t, n), dev)
        dh_res = _zeros_if_none(dh_res, (t, n, n), dev)
        dmix, dss, dalpha, dbias = _coeffs_bwd(mix, ss, al, b, dh_pre, dh_post, dh_res, cfg, n * c, launch)
        da, dw = _project_bwd(x.view(t, n * c), w, dmix, dss, h_pre=h_pre, dlin=dlin, n=n, c=c, launch=launch)
        return da.view(t, n, c), dw.to(phi_dt), dalpha.to(a_dt), dbias.to(b_dt), None


def mhc_pre_side(x, phi, alpha, bias, cfg: MHCConfig):
    """Projection, coefficients and pre read for variant 'mhc' -> (layer input [T, C], H_pre, H_post, H_res).
    Equal to reference.pre(x, H_pre) after reference.coefficients(*reference.project(x, phi), ...)."""
    if cfg.variant != "mhc":
        raise ValueError(f"mhc_pre_side fuses the Sinkhorn variant only; got variant={cfg.variant!r}")
    reference._check_x(x)
    t, n, c = x.shape
    if n != cfg.n or phi.shape != (n * c, cfg.num_mix):
        raise ValueError(f"x must have n={cfg.n} streams and phi shape [n*C, m] = [{n * c}, {cfg.num_mix}], "
                         f"got x {tuple(x.shape)} and phi {tuple(phi.shape)}")
    return _MHCPreSide.apply(x, phi, alpha, bias, cfg)
