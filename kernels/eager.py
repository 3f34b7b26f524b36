"""The ops `backend='auto'` runs where the Triton kernels do not (CPU without the interpreter, fp64 streams, CUDA
without triton): the reference's math (kernels/reference.py, same signatures) in fewer, larger PyTorch ops.

Shape letters: T tokens, n residual streams, C hidden size of one stream, m projection width.

On a CPU every op costs microseconds of dispatch (and its autograd node as much again) whatever its size, and
mHC's coefficient math is hundreds of tiny ops per sub-layer; at `tiny`'s 64 tokens per micro-batch that, not
arithmetic, was an mHC sub-layer's time. So:
* Sinkhorn is one autograd node (kernels.sinkhorn_node: the rounds as diagonal scalings, a hand-written backward
  that recomputes them from the saved logits) instead of autograd through 20 unrolled rounds;
* the three gated logit blocks are one scale-and-shift of the whole mix row (a per-column gate gathered from
  alpha) instead of three, and one sigmoid covers pre and post;
* the pre read and the post + res write are batched matrix products (`bmm`, `baddbmm`), not `einsum`.
Values and gradients equal the reference's to rounding: the products associate differently (1 ulp), nothing
else changes (tests/kernels/test_sinkhorn_node.py, fp64 to 1e-12 in relative norm; bench/eager_ops_cpu.py
times both). 'hc' and 'mhc-lite' have no Sinkhorn: their coefficients are the reference's.
`backend='reference'` keeps the unrolled definition of truth.
"""
from __future__ import annotations

import torch

from . import reference
from .config import MHCConfig
from .reference import acc_dtype, contract, expand, project
from .sinkhorn_node import sinkhorn_node as sinkhorn

__all__ = ["project", "coefficients", "pre", "post_res", "expand", "contract", "sinkhorn", "acc_dtype"]

_GATE_INDEX: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _gate_index(n: int, m: int, device: torch.device) -> torch.Tensor:
    """Which alpha gates each column of the mix row: n x pre (0), n x post (1), m - 2n x res (2)."""
    key = (n, m, device)
    idx = _GATE_INDEX.get(key)
    if idx is None:
        idx = _GATE_INDEX[key] = torch.tensor([0] * n + [1] * n + [2] * (m - 2 * n), device=device)
    return idx


def coefficients(mix: torch.Tensor, sumsq: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor, cfg: MHCConfig,
                 width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reference.coefficients: logits = alpha_gate * mix / rms + bias in one pass, H_pre = sigmoid (+ eps),
    H_post = 2 sigmoid, H_res = Sinkhorn (one node)."""
    if cfg.variant not in ("mhc", "mhc-sp"):
        return reference.coefficients(mix, sumsq, alpha, bias, cfg, width)
    n = cfg.n
    dt = acc_dtype(mix)
    mix, sumsq, alpha, bias = mix.to(dt), sumsq.to(dt), alpha.to(dt), bias.to(dt)
    reference.check_coefficient_inputs(mix, alpha, bias, cfg)
    rinv = torch.rsqrt(sumsq[:, None] / width + cfg.rms_eps)  # [T, 1]
    logits = torch.addcmul(bias, mix * rinv, alpha[_gate_index(n, mix.shape[1], mix.device)])  # [T, m]
    gates = torch.sigmoid(logits[:, : 2 * n])
    h_pre = gates[:, :n]
    if cfg.sinkhorn_form == "softmax":
        h_pre = h_pre + cfg.eps
    h_post = 2.0 * gates[:, n:]
    h_res = sinkhorn(logits[:, 2 * n :].reshape(-1, n, n), cfg.sinkhorn_iters, cfg.sinkhorn_form, cfg.eps)
    return h_pre, h_post, h_res


def pre(x: torch.Tensor, h_pre: torch.Tensor) -> torch.Tensor:
    """reference.pre: [T, C] = sum_j H_pre[j] x[j], as [T, 1, n] @ [T, n, C]."""
    reference.check_pre_inputs(x, h_pre)
    dt = acc_dtype(x)
    return torch.bmm(h_pre.to(dt)[:, None, :], x.to(dt)).squeeze(1).to(x.dtype)


def post_res(x: torch.Tensor, y: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor) -> torch.Tensor:
    """reference.post_res: x_next = H_res @ x + H_post (outer) y, as one baddbmm [T, n, n] @ [T, n, C]."""
    reference.check_post_res_inputs(x, y, h_post, h_res)
    dt = acc_dtype(x)
    out = torch.baddbmm(h_post.to(dt)[:, :, None] * y.to(dt)[:, None, :], h_res.to(dt), x.to(dt))
    return out.to(x.dtype)
