"""The definition of truth: pure-PyTorch mHC math (mhc.md §2-§3). The fused kernels share these signatures.

Shape letters: T tokens, n residual streams, C hidden size of one stream, m projection width.
Coefficient math runs in fp32 (fp64 when the inputs are fp64, for gradcheck); stream outputs keep x's dtype.
Conventions (pinned once, mhc.md §2.1-2.2): H_res[i, j] carries stream j into stream i, x_next = H_res @ x;
the mix vector is [pre (n) | post (n) | res], res reshaped row-major (m_res[i*n + j] = H_res~[i, j]).
"""
from __future__ import annotations

import torch

from .config import MHCConfig
from .sinkhorn import permutation_mix, sinkhorn

__all__ = ["project", "coefficients", "pre", "post_res", "expand", "contract", "sinkhorn", "acc_dtype"]


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _check_x(x: torch.Tensor, name: str = "x") -> None:
    if x.dim() != 3:
        raise ValueError(f"{name} must be [T, n, C], got shape {tuple(x.shape)}; reshape tokens to one dim first")


def project(x: torch.Tensor, phi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel 1. x [T, n, C], phi [n*C, m] -> (mix [T, m], sumsq [T]), one read of x (norm after matmul)."""
    _check_x(x)
    t, n, c = x.shape
    if phi.dim() != 2 or phi.shape[0] != n * c:
        raise ValueError(f"phi must be [n*C, m] = [{n * c}, m], got {tuple(phi.shape)}")
    dt = acc_dtype(x)
    v = x.reshape(t, n * c).to(dt)
    return v @ phi.to(dt), (v * v).sum(dim=-1)


def _inv_rms(sumsq: torch.Tensor, width: int, rms_eps: float) -> torch.Tensor:
    return torch.rsqrt(sumsq / width + rms_eps)


def coefficients(
    mix: torch.Tensor,
    sumsq: torch.Tensor,
    alpha: torch.Tensor,
    bias: torch.Tensor,
    cfg: MHCConfig,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kernels 2+3. Projection output -> (H_pre [T, n], H_post [T, n], H_res [T, n, n]), all fp32.

    mhc / mhc-lite: mix [T, m], sumsq [T], width = n*C. hc: mix [T, n, n+2], sumsq [T, n], width = C
    (the per-stream RMSNorm of HC). alpha [3] = (alpha_pre, alpha_post, alpha_res), bias [2n + res].
    """
    n = cfg.n
    dt = acc_dtype(mix)
    mix, sumsq, alpha, bias = mix.to(dt), sumsq.to(dt), alpha.to(dt), bias.to(dt)
    check_coefficient_inputs(mix, alpha, bias, cfg)
    b_pre, b_post, b_res = bias[:n], bias[n : 2 * n], bias[2 * n :]

    if cfg.variant == "hc":
        z = torch.tanh(mix * _inv_rms(sumsq, width, cfg.rms_eps)[..., None])  # [T, n(from j), n+2]
        h_pre = alpha[0] * z[..., 0] + b_pre
        h_post = alpha[1] * z[..., 1] + b_post
        # theta_res x~^T: entry [i, j] pairs theta_res row i with stream j's normed vector.
        h_res = alpha[2] * z[..., 2:].transpose(-1, -2) + b_res.view(n, n)
        return h_pre, h_post, h_res

    rinv = _inv_rms(sumsq, width, cfg.rms_eps)[:, None]
    m_pre = rinv * alpha[0] * mix[:, :n] + b_pre
    m_post = rinv * alpha[1] * mix[:, n : 2 * n] + b_post
    m_res = rinv * alpha[2] * mix[:, 2 * n :] + b_res
    pre_eps = cfg.eps if cfg.sinkhorn_form == "softmax" else 0.0
    h_pre = torch.sigmoid(m_pre) + pre_eps
    h_post = 2.0 * torch.sigmoid(m_post)
    if cfg.variant == "mhc-lite":
        h_res = permutation_mix(m_res, n)
    else:
        h_res = sinkhorn(m_res.view(-1, n, n), cfg.sinkhorn_iters, cfg.sinkhorn_form, cfg.eps)
    return h_pre, h_post, h_res


def check_coefficient_inputs(mix: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor, cfg: MHCConfig) -> None:
    """The argument checks of `coefficients` (shared with kernels.eager), each naming the tensor and its shape."""
    n = cfg.n
    if cfg.variant == "residual":
        raise ValueError("variant='residual' has no coefficients; the module computes x + F(x) directly")
    if alpha.shape != (3,):
        raise ValueError(f"alpha must have shape [3] (pre, post, res), got {tuple(alpha.shape)}")
    n_bias = 2 * n + cfg.num_res_logits
    if bias.shape != (n_bias,):
        raise ValueError(f"bias must have shape [{n_bias}] = [pre n | post n | res], got {tuple(bias.shape)}")
    if cfg.variant == "hc":
        if mix.dim() != 3 or mix.shape[1:] != (n, n + 2):
            raise ValueError(f"hc mix must be [T, n, n+2] = [T, {n}, {n + 2}], got {tuple(mix.shape)}")
    elif mix.dim() != 2 or mix.shape[1] != cfg.num_mix:
        raise ValueError(f"mix must be [T, {cfg.num_mix}] for variant={cfg.variant!r}, got {tuple(mix.shape)}")


def pre(x: torch.Tensor, h_pre: torch.Tensor) -> torch.Tensor:
    """Kernel 4 (pre read). x [T, n, C], H_pre [T, n] -> sub-layer input [T, C] = sum_j H_pre[j] x[j]."""
    check_pre_inputs(x, h_pre)
    dt = acc_dtype(x)
    return torch.einsum("tj,tjc->tc", h_pre.to(dt), x.to(dt)).to(x.dtype)


def check_pre_inputs(x: torch.Tensor, h_pre: torch.Tensor) -> None:
    _check_x(x)
    if h_pre.shape != x.shape[:2]:
        raise ValueError(f"h_pre must be [T, n] = {tuple(x.shape[:2])}, got {tuple(h_pre.shape)}")


def post_res(x: torch.Tensor, y: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor) -> torch.Tensor:
    """Kernel 5 (post + res write, merged). x_next[i] = sum_j H_res[i, j] x[j] + H_post[i] y -> [T, n, C]."""
    check_post_res_inputs(x, y, h_post, h_res)
    dt = acc_dtype(x)
    out = torch.einsum("tij,tjc->tic", h_res.to(dt), x.to(dt)) + h_post.to(dt)[:, :, None] * y.to(dt)[:, None, :]
    return out.to(x.dtype)


def check_post_res_inputs(x: torch.Tensor, y: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor) -> None:
    _check_x(x)
    t, n, c = x.shape
    if y.shape != (t, c):
        raise ValueError(f"y (the sub-layer output) must be [T, C] = [{t}, {c}], got {tuple(y.shape)}")
    if h_post.shape != (t, n) or h_res.shape != (t, n, n):
        raise ValueError(
            f"h_post must be [T, n] = [{t}, {n}] and h_res [T, n, n] = [{t}, {n}, {n}], "
            f"got {tuple(h_post.shape)} and {tuple(h_res.shape)}"
        )


def expand(h: torch.Tensor, n: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Stack entry, once per stack: h [T, C] -> x_0 [T, n, C]; copies, or LSS h * s_i with scale s [n, C]."""
    if h.dim() != 2:
        raise ValueError(f"h must be [T, C], got shape {tuple(h.shape)}")
    if scale is None:
        return h[:, None, :].expand(h.shape[0], n, h.shape[1]).contiguous()
    if scale.shape != (n, h.shape[1]):
        raise ValueError(f"LSS scale must be [n, C] = [{n}, {h.shape[1]}], got {tuple(scale.shape)}")
    return h[:, None, :] * scale.to(h.dtype)[None]


def contract(x: torch.Tensor) -> torch.Tensor:
    """Stack exit (pinned default, MLM output_contract): the mean over streams, [T, n, C] -> [T, C]."""
    _check_x(x)
    return x.mean(dim=1)
