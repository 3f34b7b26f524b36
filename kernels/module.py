"""nn.Modules: one sub-layer F wrapped in the chosen hyper-connection variant, and the stack entry (expand).

Shape letters: T tokens, n streams, C hidden (= `hidden`). x is the residual state [T, n, C]; F maps
[T, C] -> [T, C] and owns its own pre-norm. Expand once at stack entry and contract once at exit, never per
block (mhc.md §9 pitfall 5).

Recompute (mhc.md §5) uses the three pieces separately: `coefficients(x)` (cheap, may be stored),
`apply_pre(x, coeffs)` and `apply_post_res(x, y, coeffs)` with a stored F output y; `forward` is their
composition (for 'mhc' on the fused backend, the first two run as one autograd node with one dx write).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from . import dispatch, reference
from .config import MHCConfig


class Coefficients(NamedTuple):
    """Per-token mixing coefficients, fp32: h_pre [T, n], h_post [T, n], h_res [T, n, n] (to i, from j)."""

    h_pre: torch.Tensor
    h_post: torch.Tensor
    h_res: torch.Tensor


class MHCSublayer(nn.Module):
    """x_next = H_res x + H_post^T F(H_pre x) (mhc.md §2.1); variant 'residual' (n = 1) is exactly x + F(x)."""

    def __init__(self, config: MHCConfig, sublayer: nn.Module, hidden: int, layer_index: int = 0):
        super().__init__()
        if hidden < 1:
            raise ValueError(f"hidden={hidden} must be >= 1 (the stream width C)")
        self.config = config
        self.sublayer = sublayer
        self.hidden = hidden
        n, c = config.n, hidden
        if config.variant == "residual":
            return
        self.layer_index = layer_index
        # Parameters stay fp32 whatever dtype the streams use (mhc.md §2.2).
        k = c if config.variant == "hc" else n * c
        self.phi = nn.Parameter(torch.randn(k, config.num_mix) / k**0.5)
        self.alpha = nn.Parameter(torch.full((3,), float(config.alpha_init)))
        self.bias = nn.Parameter(self._bias_init(self.phi.device))

    def _bias_init(self, device) -> torch.Tensor:
        n = self.config.n
        bias = torch.zeros(2 * n + self.config.num_res_logits, device=device)
        if self.config.variant == "hc":
            # HC's static init: read stream (layer mod n), write every stream, identity residual mixing.
            bias[self.layer_index % n] = 1.0
            bias[n : 2 * n] = 1.0
            bias[2 * n :] = torch.eye(n, device=device).flatten()
        return bias

    def reset_parameters(self) -> None:
        """The init of __init__, in place (a model built on the meta device is initialised by it)."""
        if self.config.variant == "residual":
            return
        with torch.no_grad():
            k = self.phi.shape[0]
            self.phi.copy_(torch.randn(self.phi.shape, device=self.phi.device) / k**0.5)
            self.alpha.fill_(float(self.config.alpha_init))
            self.bias.copy_(self._bias_init(self.bias.device))

    def _check(self, x: torch.Tensor) -> None:
        n, c = self.config.n, self.hidden
        if x.dim() != 3 or x.shape[1] != n or x.shape[2] != c:
            raise ValueError(f"x must be [T, n, C] = [T, {n}, {c}] (config.n, hidden), got {tuple(x.shape)}")

    def _ops(self, x: torch.Tensor):
        return dispatch.resolve(self.config.backend, x)

    def coefficients(self, x: torch.Tensor) -> Coefficients:
        """H_pre, H_post, H_res from the residual state (projection + RMS + gates + Sinkhorn/perm/tanh)."""
        self._check(x)
        if self.config.variant == "residual":
            raise ValueError("variant='residual' has no coefficients; call forward, which computes x + F(x)")
        ops = self._ops(x)
        t, n, c = x.shape
        if self.config.variant == "hc":
            # HC normalises each stream on its own: project [T*n, C] rows, width C.
            mix, ss = ops.project(x.reshape(t * n, 1, c), self.phi)
            mix, ss, width = mix.view(t, n, -1), ss.view(t, n), c
        else:
            (mix, ss), width = ops.project(x, self.phi), n * c
        return Coefficients(*ops.coefficients(mix, ss, self.alpha, self.bias, self.config, width))

    def apply_pre(self, x: torch.Tensor, coeffs: Coefficients) -> torch.Tensor:
        """The sub-layer input H_pre x -> [T, C]."""
        self._check(x)
        return self._ops(x).pre(x, coeffs.h_pre)

    def apply_post_res(self, x: torch.Tensor, y: torch.Tensor, coeffs: Coefficients) -> torch.Tensor:
        """Merged write H_res x + H_post^T y -> [T, n, C], y = F's output [T, C]."""
        self._check(x)
        return self._ops(x).post_res(x, y, coeffs.h_post, coeffs.h_res)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        if self.config.variant == "residual":
            return x + self.sublayer(x[:, 0])[:, None]
        ops = self._ops(x)
        if self.config.variant == "mhc" and hasattr(ops, "mhc_pre_side"):  # the fused kernels' one-node pre side
            lin, _h_pre, h_post, h_res = ops.mhc_pre_side(x, self.phi, self.alpha, self.bias, self.config)
            return ops.post_res(x, self.sublayer(lin), h_post, h_res)
        coeffs = self.coefficients(x)
        return self.apply_post_res(x, self.sublayer(self.apply_pre(x, coeffs)), coeffs)

    def extra_repr(self) -> str:
        cfg = self.config
        return f"variant={cfg.variant}, n={cfg.n}, hidden={self.hidden}, backend={cfg.backend}"


class StreamExpand(nn.Module):
    """Stack entry h [T, C] -> x_0 [T, n, C]: copies, or LSS per-stream learned scaling s [n, C]."""

    def __init__(self, config: MHCConfig, hidden: int):
        super().__init__()
        self.n = config.n
        self.hidden = hidden
        self.scale: nn.Parameter | None = None
        if config.expand == "lss":
            self.scale = nn.Parameter(torch.empty(config.n, hidden))
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """LSS init (hc-stream-collapse `lss_init`): Xavier-uniform + 0.6, different per stream."""
        if self.scale is not None:
            with torch.no_grad():
                nn.init.xavier_uniform_(self.scale)
                self.scale.add_(0.6)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if h.dim() != 2 or h.shape[1] != self.hidden:
            raise ValueError(f"h must be [T, C] = [T, {self.hidden}], got {tuple(h.shape)}")
        return reference.expand(h, self.n, self.scale)


def expand(h: torch.Tensor, n: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Functional stack entry (see StreamExpand)."""
    return reference.expand(h, n, scale)


def contract(x: torch.Tensor) -> torch.Tensor:
    """Stack exit: the mean over the n streams, [T, n, C] -> [T, C]."""
    return reference.contract(x)
