"""Sinkhorn as one autograd node (kernels.sinkhorn_node) and the eager ops built on it (kernels.eager): the same
values and gradients as autograd through the unrolled reference loop, in fp64 to rounding."""
from __future__ import annotations

import pytest
import torch

from kernels import dispatch, eager, reference
from kernels.config import MHCConfig
from kernels.module import MHCSublayer
from kernels.sinkhorn import sinkhorn
from kernels.sinkhorn_node import sinkhorn_node

F64 = torch.float64


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _both(logits: torch.Tensor, g: torch.Tensor, iters: int, form: str, eps: float):
    out = []
    for fn in (sinkhorn, sinkhorn_node):
        z = logits.detach().clone().requires_grad_(True)
        y = fn(z, iters, form, eps)
        (dz,) = torch.autograd.grad(y, z, g)
        out.append((y.detach(), dz))
    return out


FORMS = [("exp", 0.0), ("softmax", 1e-6), ("softmax", 1e-2), ("softmax", 0.3)]


@pytest.mark.parametrize("form,eps", FORMS, ids=lambda v: str(v))
@pytest.mark.parametrize("iters", [1, 2, 3, 20])
@pytest.mark.parametrize("shape", [(64, 4, 4), (2, 5, 3, 3), (7, 1, 1), (9, 6, 6)], ids=str)
def test_node_equals_the_unrolled_loop_fp64(form, eps, iters, shape):
    gen = torch.Generator().manual_seed(iters * 10 + shape[-1])
    logits = torch.randn(*shape, generator=gen, dtype=F64) * 2
    g = torch.randn(*shape, generator=gen, dtype=F64)
    (y_ref, dz_ref), (y, dz) = _both(logits, g, iters, form, eps)
    assert y.shape == y_ref.shape
    assert rel(y, y_ref) <= 1e-12
    if shape[-1] == 1:  # a 1x1 projection is the constant 1: zero gradient on both sides
        assert dz.abs().max() == 0 and dz_ref.abs().max() <= 1e-15
    else:
        assert rel(dz, dz_ref) <= 1e-12


def test_node_equals_the_unrolled_loop_on_peaked_logits():
    """Large logits (near-permutation matrices): the softmax base keeps the node as stable as the reference."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(256, 4, 4, generator=gen, dtype=F64) * 25
    g = torch.randn(256, 4, 4, generator=gen, dtype=F64)
    (y_ref, dz_ref), (y, dz) = _both(logits, g, 20, "exp", 0.0)
    assert torch.isfinite(dz).all()
    assert rel(y, y_ref) <= 1e-12 and rel(dz, dz_ref) <= 1e-10


def test_node_fp32_is_as_accurate_as_the_reference_fp32():
    """fp32 against an fp64 ground truth, tensor-wise: the node's error is of the reference's size."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(512, 4, 4, generator=gen, dtype=F64)
    g = torch.randn(512, 4, 4, generator=gen, dtype=F64)
    (y64, dz64), _ = _both(logits, g, 20, "exp", 0.0)
    ref32, node32 = _both(logits.float(), g.float(), 20, "exp", 0.0)
    for (y, dz) in (ref32, node32):
        assert rel(y.double(), y64) <= 1e-6 and rel(dz.double(), dz64) <= 1e-5
    assert rel(node32[1].double(), dz64) <= 10 * rel(ref32[1].double(), dz64) + 1e-7


def test_gradcheck_node():
    gen = torch.Generator().manual_seed(2)
    for form, eps in (("exp", 0.0), ("softmax", 1e-2)):
        z = torch.randn(3, 3, 3, generator=gen, dtype=F64).requires_grad_(True)
        assert torch.autograd.gradcheck(lambda t: sinkhorn_node(t, 5, form, eps), (z,))


def test_node_is_doubly_stochastic():
    m = sinkhorn_node(torch.randn(4096, 4, 4, generator=torch.Generator().manual_seed(0)), 20)
    assert (m.sum(-1) - 1).abs().max() < 1e-5  # the last step is T_r: rows exact to rounding
    assert (m.sum(-2) - 1).abs().max() < 1e-2  # columns: Sinkhorn after 20 rounds
    assert (m >= 0).all()


def test_node_errors_name_the_field():
    with pytest.raises(ValueError, match="sinkhorn_form"):
        sinkhorn_node(torch.randn(2, 3, 3), 20, "log")
    with pytest.raises(ValueError, match="sinkhorn_iters"):
        sinkhorn_node(torch.randn(2, 3, 3), 0)
    with pytest.raises(ValueError, match="square"):
        sinkhorn_node(torch.randn(2, 3, 4))


def test_auto_on_cpu_runs_the_eager_ops(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(2, 4, 8)
    assert dispatch.resolve("auto", x) is eager
    assert dispatch.resolve("auto", x.double()) is eager
    assert dispatch.resolve("reference", x) is reference


@pytest.mark.parametrize("case", [dict(variant="mhc", n=4), dict(variant="mhc", n=3, sinkhorn_form="softmax", eps=1e-3),
                                  dict(variant="mhc-sp", n=4)], ids=lambda c: f"{c['variant']}-n{c['n']}")
def test_module_eager_equals_reference(case, monkeypatch):
    """A whole wrapped sub-layer, backend 'auto' (eager on CPU) against 'reference': output and every gradient."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gen = torch.Generator().manual_seed(4)
    t, c = 16, 8
    x = torch.randn(t, case["n"], c, generator=gen, dtype=F64)
    w = torch.randn(c, c, generator=gen, dtype=F64) / c**0.5
    cfg0 = MHCConfig(**case)
    bias = torch.randn(2 * cfg0.n + cfg0.num_res_logits, generator=gen, dtype=F64)
    res = {}
    for backend in ("auto", "reference"):
        torch.manual_seed(0)
        f = torch.nn.Linear(c, c, bias=False).double()
        with torch.no_grad():
            f.weight.copy_(w)
        m = MHCSublayer(MHCConfig(backend=backend, **case), f, hidden=c).double()
        with torch.no_grad():  # O(1) gates, so the Sinkhorn path carries real gradient
            m.alpha.fill_(0.7)
            m.bias.copy_(bias)
        xi = x.clone().requires_grad_(True)
        co = m.coefficients(xi)
        out = m.apply_post_res(xi, m.sublayer(m.apply_pre(xi, co)), co)
        out.backward(torch.ones_like(out))
        res[backend] = [out.detach(), xi.grad] + [p.grad.clone() for p in m.parameters()]
    for a, b in zip(res["auto"], res["reference"]):
        assert rel(a, b) <= 1e-12


@pytest.mark.parametrize("form", ["exp", "softmax"])
@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16], ids=str)
def test_eager_ops_equal_the_reference_ops(form, dtype):
    """Each eager op against the reference op on the same inputs: values and every input's gradient."""
    gen = torch.Generator().manual_seed(6)
    t, n, c = 24, 4, 16
    cfg = MHCConfig(variant="mhc", n=n, sinkhorn_form=form, eps=1e-3)
    x = torch.randn(t, n, c, generator=gen, dtype=F64).to(dtype)
    y = torch.randn(t, c, generator=gen, dtype=F64).to(dtype)
    phi = torch.randn(n * c, cfg.num_mix, generator=gen, dtype=F64) / (n * c) ** 0.5
    alpha = torch.rand(3, generator=gen, dtype=F64) + 0.5
    bias = torch.randn(cfg.num_mix, generator=gen, dtype=F64)
    grads = {}
    for ops in (reference, eager):
        leaves = [v.clone().requires_grad_(True) for v in (x, y, phi, alpha, bias)]
        xi, yi, ph, al, bi = leaves
        mix, ss = ops.project(xi, ph)
        h_pre, h_post, h_res = ops.coefficients(mix, ss, al, bi, cfg, n * c)
        lin = ops.pre(xi, h_pre)
        out = ops.post_res(xi, yi * lin, h_post, h_res)
        loss = (out.double() * torch.linspace(-1, 1, out.numel(), dtype=F64).view(out.shape)).sum() + \
            (h_res.double() ** 2).sum()
        loss.backward()
        grads[ops.__name__] = [out.detach(), h_pre.detach(), h_post.detach(), h_res.detach()] + \
            [v.grad for v in leaves]
    tol = {F64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for a, b in zip(grads["kernels.eager"], grads["kernels.reference"]):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert rel(a.double(), b.double()) <= tol


def test_eager_ops_name_the_bad_argument():
    cfg = MHCConfig(variant="mhc", n=4)
    with pytest.raises(ValueError, match="h_pre must be"):
        eager.pre(torch.randn(3, 4, 8), torch.randn(3, 3))
    with pytest.raises(ValueError, match="y \\(the sub-layer output\\)"):
        eager.post_res(torch.randn(3, 4, 8), torch.randn(3, 7), torch.randn(3, 4), torch.randn(3, 4, 4))
    with pytest.raises(ValueError, match="alpha must have shape"):
        eager.coefficients(torch.randn(3, cfg.num_mix), torch.rand(3), torch.rand(2), torch.rand(cfg.num_mix), cfg, 32)
    with pytest.raises(ValueError, match="mix must be"):
        eager.coefficients(torch.randn(3, 5), torch.rand(3), torch.rand(3), torch.rand(cfg.num_mix), cfg, 32)
