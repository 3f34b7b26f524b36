"""MHCSublayer / StreamExpand: the API the pipeline runtime uses (forward, recompute pieces, stack helpers)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels import MHCConfig, MHCSublayer, StreamExpand, contract, diagnostics, expand


class Zero(nn.Module):
    def forward(self, u):
        return torch.zeros_like(u)


def _mlp(c):
    return nn.Sequential(nn.Linear(c, 2 * c), nn.GELU(), nn.Linear(2 * c, c))


def test_residual_variant_is_exactly_x_plus_f():
    torch.manual_seed(0)
    f = _mlp(16)
    m = MHCSublayer(MHCConfig(variant="residual", n=1), f, 16)
    x = torch.randn(9, 1, 16)
    assert torch.equal(m(x), x + f(x[:, 0])[:, None])
    assert list(m.parameters()) == list(f.parameters())


@pytest.mark.parametrize("variant", ["hc", "mhc", "mhc-lite"])
def test_forward_equals_recompute_pieces(variant):
    torch.manual_seed(1)
    m = MHCSublayer(MHCConfig(variant=variant, n=4, backend="reference"), _mlp(8), 8)
    x = torch.randn(5, 4, 8)
    co = m.coefficients(x)
    y = m.sublayer(m.apply_pre(x, co))
    assert torch.equal(m(x), m.apply_post_res(x, y, co))
    assert co.h_pre.shape == (5, 4) and co.h_post.shape == (5, 4) and co.h_res.shape == (5, 4, 4)


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_module_fails_if_h_res_mixing_is_dropped(backend, request):
    if backend == "fused":
        device = request.getfixturevalue("fused_device")
    else:
        device = "cpu"
    torch.manual_seed(2)
    m = MHCSublayer(MHCConfig(n=4, backend=backend), Zero(), 8).to(device)
    x = torch.randn(6, 4, 8, device=device)
    out = m(x)
    h_res = m.coefficients(x).h_res
    # With F = 0 the output is exactly the mixed residual; at init H_res ~ 1/n, far from the identity.
    assert torch.allclose(out, torch.einsum("tij,tjc->tic", h_res, x), atol=1e-5)
    assert (out - x).abs().max() > 0.1


def test_all_parameters_receive_finite_gradients():
    torch.manual_seed(3)
    cfg = MHCConfig(n=4, expand="lss", backend="reference")
    entry = StreamExpand(cfg, 8)
    layers = nn.ModuleList(MHCSublayer(cfg, _mlp(8), 8, layer_index=i) for i in range(3))
    h = torch.randn(7, 8)
    x = entry(h)
    for layer in layers:
        x = layer(x)
    out = contract(x)
    out.backward(torch.randn_like(out))
    for name, p in list(entry.named_parameters()) + list(layers.named_parameters()):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_hc_static_init_and_lss_expand():
    m = MHCSublayer(MHCConfig(variant="hc", n=4), _mlp(8), 8, layer_index=6)
    assert m.bias[:4].tolist() == [0, 0, 1, 0]  # reads stream 6 mod 4 at init
    assert torch.equal(m.bias[8:].view(4, 4), torch.eye(4))
    cfg = MHCConfig(n=4, expand="lss")
    e = StreamExpand(cfg, 16)
    h = torch.randn(3, 16)
    x = e(h)
    assert torch.allclose(x, h[:, None] * e.scale[None])
    assert diagnostics.stream_imbalance(x).imbalance > 1.0  # LSS breaks the symmetry between streams
    assert StreamExpand(MHCConfig(n=4), 16).scale is None
    assert torch.equal(expand(h, 4)[:, 3], h)


def test_bf16_streams_keep_fp32_coefficients():
    m = MHCSublayer(MHCConfig(n=2, backend="reference"), nn.Identity(), 8)
    x = torch.randn(4, 2, 8).to(torch.bfloat16)
    assert m(x).dtype == torch.bfloat16
    co = m.coefficients(x)
    assert co.h_res.dtype == torch.float32 and m.phi.dtype == torch.float32


def test_module_bad_inputs():
    m = MHCSublayer(MHCConfig(n=4), nn.Identity(), 8)
    with pytest.raises(ValueError, match=r"config\.n, hidden"):
        m(torch.randn(3, 2, 8))
    with pytest.raises(ValueError, match="hidden"):
        MHCSublayer(MHCConfig(n=4), nn.Identity(), 0)
    with pytest.raises(ValueError, match="backend"):
        MHCConfig(backend="gpu")
    with pytest.raises(ValueError, match="residual"):
        MHCSublayer(MHCConfig(variant="residual", n=1), nn.Identity(), 8).coefficients(torch.randn(2, 1, 8))
