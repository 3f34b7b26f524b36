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

from dataclasses import astuple

import torch
import triton

from . import reference
from .config import MHCConfig
from .launch import (ApplyTiles, CoeffTiles, LaunchConfig, ProjectTiles, np2, gpu_config,  # noqa: F401
                     interpreter_config, use_config)
from .launch import launch_config as _launch_config
from .triton_apply import post_res_bwd_kernel, post_res_fwd_kernel, pre_bwd_kernel, pre_fwd_kernel
from .triton_coeffs import coeffs_bwd_kernel, coeffs_fwd_kernel
from .triton_project import project_bwd_kernel, project_fwd_kernel

# Whether the @triton.jit functions above were built for the interpreter (decided at decoration time).
INTERPRETED: bool = type(pre_fwd_kernel).__name__ == "InterpretedFunction"
_STREAM_DTYPES = (torch.float32, torch.bfloat16)


def _check_stream(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dtype not in _STREAM_DTYPES:
        raise ValueError(f"{name} has dtype {x.dtype}; the fused kernels take fp32 or bf16 (use the reference "
                         "backend for fp64)")
    return x.contiguous()


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32).contiguous()


def launch_config(device: torch.device) -> LaunchConfig:
    """The configuration the fused ops launch with on `device` (kernels.launch.launch_config)."""
    return _launch_config(device, INTERPRETED)


# ---------------------------------------------------------------- kernel 1: projection + sum of squares
def _project_fwd(a: torch.Tensor, w: torch.Tensor, launch: LaunchConfig | None = None):
    """(mix [r, m], sumsq [r]) fp32 for A [r, k] (stream dtype) and phi [k, m] fp32."""
    r, k = a.shape
    m = w.shape[1]
    tiles = (launch or launch_config(a.device)).project_fwd(r, k, m, a.dtype)
    mix = torch.empty(tiles.split, r, m, device=a.device, dtype=torch.float32)
    ss = torch.empty(tiles.split, r, device=a.device, dtype=torch.float32)
    project_fwd_kernel[tiles.grid](a, w, mix, ss, r, k, m, tiles.per_split, BLOCK_R=tiles.block_r,
                                   BLOCK_K=tiles.block_k, BLOCK_M=tiles.block_m, PRECISION=tiles.precision)
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
        consts["EPS_DIV"], consts["EPS_ADD"], N=n, NP=np2(n), ITERS=cfg.sinkhorn_iters, BLOCK_T=tiles.block_t)
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
        consts["rms_eps"], consts["EPS_DIV"], consts["EPS_ADD"], N=n, NP=np2(n), ITERS=cfg.sinkhorn_iters,
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
    if cfg.variant not in ("mhc", "mhc-sp"):  # mhc-sp: exactly mHC's coefficients
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
        x, h_pre, out, t, c, N=n, NP=np2(n), BLOCK_T=block_t, BLOCK_C=block_c)
    return out


def _pre_bwd(x, h_pre, dout, write_dx: bool, launch: LaunchConfig | None = None):
    t, n, c = x.shape
    block_t, block_c = astuple((launch or launch_config(x.device)).apply(c, n))
    dh = torch.empty(t, n, device=x.device, dtype=torch.float32)
    dx = torch.empty_like(x) if write_dx else dh
    pre_bwd_kernel[(triton.cdiv(t, block_t),)](x, h_pre, dout, dx, dh, t, c, N=n, NP=np2(n), WRITE_DX=write_dx,
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
            x, y, hp, hr, out, t, c, N=n, NP=np2(n), BLOCK_T=block_t, BLOCK_C=block_c)
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
            x, y, hp, hr, dout, dx, dy, dhp, dhr, t, c, N=n, NP=np2(n), BLOCK_T=block_t, BLOCK_C=block_c)
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
