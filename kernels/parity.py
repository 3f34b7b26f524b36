"""One pass through every mHC op (pre side, then post+res) with its backward, for parity checks of an
implementation against another (tests/kernels, bench/kernel_parity.py): same inputs, outputs in NAMES order."""
from __future__ import annotations

import torch

def parity_inputs(t: int, n: int, c: int, dtype: torch.dtype, device, seed: int):
    """(cfg, leaves = [x, phi, alpha, bias, scale, y0], upstream gradient g) for `run_ops`, drawn on the host from
    `seed` (the same numbers on every device): streams in `dtype`, O(1) gates so the dynamic path carries weight,
    a random upstream gradient (never all-ones, mhc.md §4.4)."""
    from kernels.config import MHCConfig

    gen = torch.Generator().manual_seed(seed)
    cfg = MHCConfig(n=n)

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    x = r(t, n, c).to(dtype)
    phi = r(n * c, cfg.num_mix) / (n * c) ** 0.5
    alpha = torch.rand(3, generator=gen) + 0.5
    bias = r(cfg.num_mix) * 0.5
    scale, y0 = r(c).to(dtype), r(t, c).to(dtype)
    g = r(t, n, c).to(dtype)
    return cfg, [v.to(device) for v in (x, phi, alpha, bias, scale, y0)], g.to(device)


NAMES = ["out", "lin", "h_pre", "h_post", "h_res", "dx", "dphi", "dalpha", "dbias", "dscale", "dy0"]


def run_ops(ops, leaves, g, cfg, combined: bool, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Forward and backward through `ops` (kernels.reference or kernels.fused) on fresh copies of
    leaves = (x, phi, alpha, bias, scale, y0); `dtype` casts the streams (x, scale, y0). The sub-layer is
    F(u) = u * scale + y0, which routes the gradient through pre. `combined`: the fused pre side in one call.
    Returns the outputs named in NAMES: out, lin, h_pre, h_post, h_res, then the leaves' gradients."""
    leaves = [v.detach().clone().to(dtype if dtype is not None and i in (0, 4, 5) else v.dtype).requires_grad_()
              for i, v in enumerate(leaves)]
    x, phi, alpha, bias, scale, y0 = leaves
    t, n, c = x.shape
    if combined:
        lin, hp, hq, hr = ops.mhc_pre_side(x, phi, alpha, bias, cfg)
    else:
        mix, ss = ops.project(x, phi)
        hp, hq, hr = ops.coefficients(mix, ss, alpha, bias, cfg, n * c)
        lin = ops.pre(x, hp)
    out = ops.post_res(x, lin * scale + y0, hq, hr)
    out.backward(g.to(out.dtype))
    return [out, lin, hp, hq, hr] + [v.grad for v in leaves]
