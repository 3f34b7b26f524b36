"""The pure-PyTorch reference: gradients, Sinkhorn constraints, conventions, variants, diagnostics, errors."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import diagnostics, reference
from kernels.config import MHCConfig
from kernels.sinkhorn import permutation_matrices, sinkhorn

F64 = torch.float64


def _params(cfg: MHCConfig, c: int, gen: torch.Generator, dtype=F64, bias_scale=0.5):
    n = cfg.n
    k = c if cfg.variant == "hc" else n * c
    phi = torch.randn(k, cfg.num_mix, generator=gen, dtype=dtype) / k**0.5
    alpha = torch.rand(3, generator=gen, dtype=dtype) + 0.5  # O(1) gates: 0.01 would hide the dynamic path
    bias = torch.randn(2 * n + cfg.num_res_logits, generator=gen, dtype=dtype) * bias_scale
    return phi, alpha, bias


def _layer(x, phi, alpha, bias, w_f, cfg: MHCConfig):
    """One wrapped sub-layer in reference math, F(u) = tanh(u @ w_f)."""
    t, n, c = x.shape
    if cfg.variant == "hc":
        mix, ss = reference.project(x.reshape(t * n, 1, c), phi)
        hp, hq, hr = reference.coefficients(mix.view(t, n, -1), ss.view(t, n), alpha, bias, cfg, c)
    else:
        mix, ss = reference.project(x, phi)
        hp, hq, hr = reference.coefficients(mix, ss, alpha, bias, cfg, n * c)
    y = torch.tanh(reference.pre(x, hp) @ w_f)
    return reference.post_res(x, y, hq, hr)


CASES = [
    dict(variant="mhc", n=3, sinkhorn_form="exp", sinkhorn_iters=20),
    dict(variant="mhc", n=2, sinkhorn_form="softmax", sinkhorn_iters=20, eps=1e-3),
    dict(variant="mhc-lite", n=3),
    dict(variant="hc", n=3),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['variant']}-{c.get('sinkhorn_form', '')}")
def test_gradcheck_reference_variants(case):
    cfg = MHCConfig(**case)
    gen = torch.Generator().manual_seed(1)
    t, c = 3, 4
    x = torch.randn(t, cfg.n, c, generator=gen, dtype=F64)
    phi, alpha, bias = _params(cfg, c, gen)
    w_f = torch.randn(c, c, generator=gen, dtype=F64) / 2
    inputs = [v.requires_grad_() for v in (x, phi, alpha, bias, w_f)]
    assert torch.autograd.gradcheck(lambda *a: _layer(*a, cfg), inputs, eps=1e-6, atol=1e-5, rtol=1e-4)


def test_gradcheck_residual_and_expand():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 1, 5, generator=gen, dtype=F64, requires_grad=True)
    w = torch.randn(5, 5, generator=gen, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: x + torch.tanh(x[:, 0] @ w)[:, None], (x, w))
    h = torch.randn(4, 5, generator=gen, dtype=F64, requires_grad=True)
    s = torch.randn(3, 5, generator=gen, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda h, s: reference.contract(reference.expand(h, 3, s) ** 2), (h, s))


@pytest.mark.parametrize("form", ["exp", "softmax"])
@pytest.mark.parametrize("iters", [1, 2, 20])
def test_gradcheck_sinkhorn(form, iters):
    gen = torch.Generator().manual_seed(iters)
    logits = torch.randn(5, 4, 4, generator=gen, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: sinkhorn(z, iters, form, 1e-3), (logits,))


@pytest.mark.parametrize("form", ["exp", "softmax"])
def test_sinkhorn_is_doubly_stochastic(form):
    gen = torch.Generator().manual_seed(3)
    m = sinkhorn(torch.randn(4096, 4, 4, generator=gen), 20, form)
    assert torch.isfinite(m).all() and (m >= 0).all()
    assert (m.sum(-1) - 1).abs().max() < 1e-5  # last step is T_r: rows exact to rounding
    assert (m.sum(-2) - 1).abs().max() < 1e-3


def test_sinkhorn_softmax_form_with_zero_eps_equals_exp_form():
    z = torch.randn(64, 4, 4, dtype=F64) * 3
    assert torch.allclose(sinkhorn(z, 20, "softmax", 0.0), sinkhorn(z, 20, "exp"), atol=1e-13, rtol=0)
    assert not torch.allclose(sinkhorn(z, 20, "softmax", 1e-2), sinkhorn(z, 20, "exp"), atol=1e-6)


def test_mhc_lite_is_exactly_doubly_stochastic():
    p = permutation_matrices(4)
    assert p.shape == (24, 4, 4) and torch.equal(p[0], torch.eye(4))
    cfg = MHCConfig(variant="mhc-lite", n=4)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(9, 4, 8, generator=gen)
    phi, alpha, bias = _params(cfg, 8, gen, torch.float32, bias_scale=3.0)
    _, _, hr = reference.coefficients(*reference.project(x, phi), alpha, bias, cfg, 32)
    assert (hr >= 0).all()
    assert (hr.sum(-1) - 1).abs().max() < 1e-6 and (hr.sum(-2) - 1).abs().max() < 1e-6


def test_composite_gain_mhc_bounded_hc_explodes():
    gen = torch.Generator().manual_seed(5)
    t, n, c, depth = 32, 4, 16, 60
    gains = {}
    for variant in ("mhc", "hc"):
        cfg = MHCConfig(variant=variant, n=n)
        hs = []
        for _ in range(depth):
            x = torch.randn(t, n, c, generator=gen)
            phi, _, bias = _params(cfg, c, gen, torch.float32, bias_scale=1.0)
            if variant == "hc":
                bias[2 * n :] = torch.eye(n).flatten()  # HC's identity init; the tanh term is unconstrained
                mix, ss = reference.project(x.reshape(t * n, 1, c), phi)
                _, _, hr = reference.coefficients(mix.view(t, n, -1), ss.view(t, n), torch.ones(3), bias, cfg, c)
            else:
                _, _, hr = reference.coefficients(*reference.project(x, phi), torch.ones(3), bias, cfg, n * c)
            hs.append(hr)
        gains[variant] = diagnostics.composite_gain(torch.stack(hs))
    assert gains["mhc"].forward.max() <= 2 and gains["mhc"].backward.max() <= 2
    assert gains["hc"].forward.max() > 1e3 and gains["hc"].backward.max() > 1e3


def test_amax_gain_definition():
    m = torch.tensor([[1.0, -2.0], [0.5, 0.25]])
    g = diagnostics.amax_gain(m)
    assert g.forward.item() == 3.0 and g.backward.item() == 2.25
    swap, scale = torch.tensor([[0.0, 1.0], [1.0, 0.0]]), torch.diag(torch.tensor([2.0, 1.0]))
    p = diagnostics.composite(torch.stack([swap, scale]))
    assert torch.equal(p, torch.tensor([[0.0, 2.0], [1.0, 0.0]], dtype=F64))  # H_1 @ H_0, layer 0 applied first


def test_stream_imbalance_detects_collapse():
    x = torch.randn(16, 4, 32)
    assert diagnostics.stream_imbalance(x).imbalance < 1.5
    x[:, 2] *= 100
    stats = diagnostics.stream_imbalance(x)
    assert stats.imbalance > 50 and stats.norms.argmax().item() == 2


def test_orientation_single_entry_moves_stream_j_into_i():
    t, n, c = 3, 4, 8
    x = torch.randn(t, n, c)
    hr = torch.zeros(t, n, n)
    hr[:, 1, 3] = 1.0  # to stream 1, from stream 3
    out = reference.post_res(x, torch.randn(t, c), torch.zeros(t, n), hr)
    assert torch.equal(out[:, 1], x[:, 3])
    assert torch.equal(out[:, [0, 2, 3]], torch.zeros(t, 3, c))


def test_mix_order_pre_post_res_row_major():
    n, c, t = 3, 4, 2
    cfg = MHCConfig(n=n, sinkhorn_iters=1)
    bias = torch.randn(2 * n + n * n)
    x = torch.randn(t, n, c)
    mix, ss = reference.project(x, torch.zeros(n * c, cfg.num_mix))  # phi = 0: coefficients come from bias
    hp, hq, hr = reference.coefficients(mix, ss, torch.ones(3), bias, cfg, n * c)
    assert torch.allclose(hp[0], torch.sigmoid(bias[:n]))
    assert torch.allclose(hq[0], 2 * torch.sigmoid(bias[n : 2 * n]))
    b = bias[2 * n :]
    manual = torch.tensor([[b[i * n + j].item() for j in range(n)] for i in range(n)])  # [i, j] = to i, from j
    assert torch.allclose(hr[0], sinkhorn(manual, 1))
    assert not torch.allclose(hr[0], sinkhorn(manual.T.contiguous(), 1))


def test_h_res_is_applied_and_identity_passes_through():
    t, n, c = 4, 4, 8
    x, y = torch.randn(t, n, c), torch.randn(t, c)
    eye = torch.eye(n).expand(t, n, n)
    assert torch.equal(reference.post_res(x, y, torch.zeros(t, n), eye), x)
    hr = sinkhorn(torch.randn(t, n, n), 20)
    base = reference.post_res(x, y, torch.rand(t, n), hr)
    bumped = hr.clone()
    bumped[:, 0, 1] += 0.1
    assert (reference.post_res(x, y, torch.rand(t, n), bumped) - base).abs().max() > 1e-3


def test_norm_after_matmul_equals_rmsnorm_then_projection():
    t, n, c = 5, 4, 16
    x, phi = torch.randn(t, n, c, dtype=F64), torch.randn(n * c, 24, dtype=F64)
    mix, ss = reference.project(x, phi)
    v = x.reshape(t, -1)
    normed = v / torch.sqrt((v * v).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(mix * torch.rsqrt(ss / (n * c) + 1e-6)[:, None], normed @ phi, rtol=1e-12)


def test_expand_contract():
    h = torch.randn(5, 8)
    x = reference.expand(h, 4)
    assert x.shape == (5, 4, 8) and torch.equal(reference.contract(x), h)
    s = torch.randn(4, 8)
    assert torch.allclose(reference.expand(h, 4, s)[:, 2], h * s[2])


def test_bad_inputs_raise_clear_value_errors():
    with pytest.raises(ValueError, match="n <= 4"):
        MHCConfig(variant="mhc-lite", n=5)
    with pytest.raises(ValueError, match="variant"):
        MHCConfig(variant="mhc2")
    with pytest.raises(ValueError, match="n=1"):
        MHCConfig(variant="residual", n=4)
    with pytest.raises(ValueError, match=r"\[T, n, C\]"):
        reference.pre(torch.randn(4, 8), torch.randn(4, 1))
    with pytest.raises(ValueError, match="phi"):
        reference.project(torch.randn(2, 4, 8), torch.randn(31, 24))
    with pytest.raises(ValueError, match="h_res"):
        reference.post_res(torch.randn(2, 4, 8), torch.randn(2, 8), torch.randn(2, 4), torch.randn(2, 3, 3))
    with pytest.raises(ValueError, match="sinkhorn_form"):
        sinkhorn(torch.randn(4, 4), 20, "log")


def test_import_without_triton_falls_back_to_reference():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, kernels\n"
        "assert 'triton' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "m = kernels.MHCSublayer(kernels.MHCConfig(n=2), torch.nn.Identity(), 8)\n"
        "assert m(torch.randn(3, 2, 8)).shape == (3, 2, 8)\n"
        "m = kernels.MHCSublayer(kernels.MHCConfig(n=2, backend='fused'), torch.nn.Identity(), 8)\n"
        "try:\n    m(torch.randn(3, 2, 8))\nexcept ValueError as e:\n    assert 'triton' in str(e); print('ok')\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_num_mix_widths():
    assert MHCConfig(n=4).num_mix == 24
    assert MHCConfig(variant="mhc-lite", n=4).num_mix == 8 + math.factorial(4)
    assert MHCConfig(variant="hc", n=4).num_mix == 6
