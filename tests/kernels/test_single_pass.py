"""Single-pass mHC (kernels/single_pass.py): the recurrence, the fused-form pass, the carried-state packing.

float64 unless a test is about bf16/fp32 packing; packing is compared bit for bit (integer views).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from costmodel.physics.mhc_cost import ResidualSpec
from kernels import reference
from kernels.config import MHCConfig
from kernels.single_pass import (SinglePassSublayer, boundary_width, carry_bytes, carry_dtype, contract,
                                 entry_coefficient, pack_state, single_pass, unpack_state)

F64 = torch.float64
INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float64: torch.int64}
T, N, C = 6, 4, 8


def _mlp(c: int) -> nn.Module:
    return nn.Sequential(nn.Linear(c, 2 * c), nn.GELU(), nn.Linear(2 * c, c))


def _chain(layers: int = 4, backend: str = "reference", dtype=F64, seed: int = 0, c: int = C, **cfg):
    """Sub-layers with randomised gates and biases, so A_l, B_l, C_l differ per token and per layer."""
    torch.manual_seed(seed)
    config = MHCConfig(variant="mhc-sp", n=N, backend=backend, **cfg)
    mods = nn.ModuleList(SinglePassSublayer(config, _mlp(c), c, layer_index=i) for i in range(layers)).to(dtype)
    with torch.no_grad():
        for m in mods:
            m.alpha.uniform_(0.5, 1.5)
            m.bias.normal_()
    return mods


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(INT[t.dtype])


def _random_bits(shape, dtype, gen) -> torch.Tensor:
    """Every bit pattern of `dtype` is possible: NaN payloads, -0, subnormals, infinities."""
    info = torch.iinfo(INT[dtype])
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(INT[dtype]).view(dtype)


def _run(mods, x, a, pack: bool):
    for m in mods:
        if pack:
            x, a = unpack_state(pack_state(x, a), m.hidden)
        x, a = m(x, a)
    return x, a


def test_chain_equals_recurrence():
    mods = _chain()
    logits = torch.randn(N, dtype=F64)
    x0 = torch.randn(T, N, C, dtype=F64)
    with torch.no_grad():
        x, a = _run(mods, x0, entry_coefficient(logits, T, F64), pack=False)
        # The defining recurrence, step by step: A from layer l-1's coefficients, B and C from layer l's.
        xs, a_prev, own_pre_diff = x0, torch.sigmoid(logits).expand(T, N), 0.0
        for m in mods:
            mix, ss = reference.project(xs, m.phi)
            h_pre, h_post, h_res = reference.coefficients(mix, ss, m.alpha, m.bias, m.config, N * C)
            y = m.sublayer(reference.pre(xs, a_prev))
            own_pre_diff = max(own_pre_diff, (h_pre - a_prev).abs().max().item())
            xs, a_prev = reference.post_res(xs, y, h_post, h_res), h_pre
    assert (x - xs).abs().max() <= 1e-12 and (a - a_prev).abs().max() <= 1e-12
    assert own_pre_diff > 0.05  # the carried coefficient is not the layer's own: the test can tell them apart
    assert (contract(x, a) - torch.einsum("tj,tjc->tc", a, x)).abs().max() <= 1e-12


def test_mhc_sp_coefficients_are_mhc():
    m = _chain(1)[0]
    x = torch.randn(T, N, C, dtype=F64)
    mhc = MHCConfig(variant="mhc", n=N, backend="reference")
    ref = reference.coefficients(*reference.project(x, m.phi), m.alpha, m.bias, mhc, N * C)
    for got, want in zip(m.coefficients(x), ref):
        assert torch.equal(got, want)


def test_single_pass_equals_module_step():
    m0, m1 = _chain(2)
    x = torch.randn(T, N, C, dtype=F64)
    a_prev = torch.rand(T, N, dtype=F64)
    with torch.no_grad():
        x_next, a_l = m0(x, a_prev)
        co = m0.coefficients(x)
        y = m0.sublayer(m0.apply_pre(x, a_prev))
        xs, us = single_pass(x, y, co.h_post, co.h_res, co.h_pre)
    assert torch.equal(xs, x_next) and torch.equal(co.h_pre, a_l)
    assert torch.equal(us, m1.apply_pre(x_next, a_l))
    want_x = torch.einsum("tij,tjc->tic", co.h_res, x) + co.h_post[:, :, None] * y[:, None, :]
    assert (xs - want_x).abs().max() <= 1e-12
    assert (us - torch.einsum("tj,tjc->tc", co.h_pre, want_x)).abs().max() <= 1e-12
    view = m0.diagnostic_view(co, a_prev)
    assert view.read is a_prev and view.write is co.h_post and view.res is co.h_res


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
def test_pack_round_trip_bit_exact(dtype):
    gen = torch.Generator().manual_seed(5)
    adt = carry_dtype(dtype)
    x = _random_bits((T, N, C), dtype, gen)
    a = _random_bits((T, N), adt, gen)
    info = torch.finfo(adt)
    special = torch.tensor([1 / 3, info.tiny, info.tiny * info.eps, info.max, -0.0, float("inf"), 2 / 3, 1e-30],
                           dtype=adt)
    a[0, :] = special[:N]
    a[1, :] = special[N : 2 * N]
    packed = pack_state(x, a)
    assert packed.dtype == dtype and packed.shape == (T, N, boundary_width(C, dtype))
    x2, a2 = unpack_state(packed, C)
    assert torch.equal(_bits(x2), _bits(x)) and torch.equal(_bits(a2), _bits(a))
    assert x2.data_ptr() == packed.data_ptr()  # x is a view of the received buffer, no copy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_pack_gradients_bit_exact(dtype):
    gen = torch.Generator().manual_seed(6)
    adt = carry_dtype(dtype)
    # Receiving side: the gradient of the packed buffer is the packed gradients, bit for bit. The fp32 values
    # whose low bf16 half is -0 (0x8000) or a signalling NaN (0x7F81) break if the two parts were summed.
    packed = _random_bits((T, N, boundary_width(C, dtype)), dtype, gen).requires_grad_()
    x, a = unpack_state(packed, C)
    gx, ga = _random_bits((T, N, C), dtype, gen), _random_bits((T, N), adt, gen)
    ga[0, :2] = torch.tensor([0x3F808000, 0x3F807F81], dtype=torch.int32).view(torch.float32).to(adt)
    torch.autograd.backward([x, a], [gx, ga])
    want = torch.cat([gx, ga.unsqueeze(-1).view(dtype)], dim=-1)
    assert torch.equal(_bits(packed.grad), _bits(want))
    # Sending side: the packed gradient received from the next stage unpacks bit-exactly into dX and da.
    x = torch.randn(T, N, C).to(dtype).requires_grad_()
    a = torch.rand(T, N, dtype=adt).requires_grad_()
    g = _random_bits((T, N, boundary_width(C, dtype)), dtype, gen)
    pack_state(x, a).backward(g)
    gx_want, ga_want = g[..., :C], g[..., C:].contiguous().view(adt).squeeze(-1)
    assert torch.equal(_bits(x.grad), _bits(gx_want)) and torch.equal(_bits(a.grad), _bits(ga_want))


def test_pack_unpack_gradcheck():
    x = torch.randn(3, N, 5, dtype=F64, requires_grad=True)
    a = torch.rand(3, N, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, a: unpack_state(pack_state(x, a), 5), (x, a))
    assert torch.autograd.gradcheck(pack_state, (x, a))
    p = torch.randn(3, N, 6, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda p: unpack_state(p, 5), (p,))


@pytest.mark.parametrize("dtype", [F64, torch.bfloat16], ids=["fp64", "bf16"])
def test_chain_with_packing_equals_chain(dtype):
    mods = _chain(3, dtype=torch.float32 if dtype == torch.bfloat16 else F64)
    logits = nn.Parameter(torch.randn(N, dtype=F64 if dtype == F64 else torch.float32))
    x0 = torch.randn(T, N, C).to(dtype)
    g = torch.randn(T, C).to(dtype)
    if dtype == torch.bfloat16:
        for m in mods:
            m.sublayer.to(dtype)
    results = []
    for pack in (False, True):
        mods.zero_grad()
        logits.grad = None
        x = x0.clone().requires_grad_()
        out = contract(*_run(mods, x, entry_coefficient(logits, T, dtype), pack))
        out.backward(g)
        results.append([out, x.grad, logits.grad] + [p.grad for p in mods.parameters()])
    for plain, packed in zip(*results):
        assert torch.equal(plain, packed)


def test_contract_and_entry_coefficient():
    x = torch.randn(T, N, C, dtype=F64)
    a = torch.rand(T, N, dtype=F64)
    got = contract(x, a)
    assert (got - (a[:, :, None] * x).sum(1)).abs().max() <= 1e-12
    assert (got - x.mean(1)).abs().max() > 0.1  # not the stream mean
    logits = torch.zeros(N, requires_grad=True)
    a0 = entry_coefficient(logits, T, torch.bfloat16)
    assert a0.shape == (T, N) and a0.dtype == torch.float32 and torch.equal(a0, torch.full((T, N), 0.5))
    a0.sum().backward()
    assert torch.allclose(logits.grad, torch.full((N,), 0.25 * T))
    lg = torch.randn(N, dtype=F64)
    a64 = entry_coefficient(lg, 3, F64)
    assert a64.dtype == F64 and torch.equal(a64, torch.sigmoid(lg).expand(3, N))


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_carry_bytes_matches_cost_model(n):
    for dtype in (torch.float32, torch.bfloat16):
        assert carry_bytes(n, dtype) == ResidualSpec("mhc-sp", n).carry_bytes == 4 * n
        # The packed tensor's extra elements are exactly those bytes.
        assert (boundary_width(C, dtype) - C) * dtype.itemsize * n == carry_bytes(n, dtype)
    assert carry_bytes(n, F64) == 8 * n and boundary_width(C, F64) == C + 1


def test_bad_inputs():
    m = _chain(1)[0]
    x, a = torch.randn(T, N, C, dtype=F64), torch.rand(T, N, dtype=F64)
    with pytest.raises(ValueError, match="x must be"):
        m(torch.randn(T, N + 1, C, dtype=F64), a)
    with pytest.raises(ValueError, match="a_prev"):
        m(x, a[:, :2])
    with pytest.raises(ValueError, match="packed must be"):
        unpack_state(torch.randn(T, N, C + 3, dtype=F64), C)
    with pytest.raises(ValueError, match="a has dtype"):
        pack_state(x, a.float())
    with pytest.raises(ValueError, match="a_next"):
        single_pass(x, torch.randn(T, C, dtype=F64), a, torch.rand(T, N, N, dtype=F64), a[:1])
    with pytest.raises(ValueError, match="fp32, bf16 or fp64"):
        boundary_width(C, torch.float16)
    with pytest.raises(ValueError, match="variant"):
        SinglePassSublayer(MHCConfig(variant="mhc", n=N), _mlp(C), C)


# ---------------------------------------------------------------- fused backend (CUDA, or CPU under the interpreter)
def test_mhc_sp_fused_coefficients_use_fused_sinkhorn(fused_device):
    import kernels.fused as fused

    cfg = MHCConfig(variant="mhc-sp", n=N)
    mix = torch.randn(T, cfg.num_mix, device=fused_device, requires_grad=True)
    ss = torch.rand(T, device=fused_device) * 64 + 32
    alpha, bias = torch.ones(3, device=fused_device), torch.zeros(cfg.num_mix, device=fused_device)
    outs = fused.coefficients(mix, ss, alpha, bias, cfg, N * 64)
    assert all(type(o.grad_fn).__name__ == "_CoefficientsBackward" for o in outs)


def test_mhc_sp_fused_matches_reference(fused_device):
    mods = {b: _chain(2, backend=b, dtype=torch.float32, c=64, seed=3).to(fused_device)
            for b in ("reference", "fused")}
    mods["fused"].load_state_dict(mods["reference"].state_dict())
    x0 = torch.randn(7, N, 64, device=fused_device)
    a0 = torch.rand(7, N, device=fused_device)
    g = torch.randn(7, 64, device=fused_device)
    res = {}
    for b, ms in mods.items():
        x, a = x0.clone().requires_grad_(), a0.clone().requires_grad_()
        out = contract(*_run(ms, x, a, pack=True))
        out.backward(g)
        res[b] = [out, x.grad, a.grad] + [p.grad for p in ms.parameters()]
    for got, want in zip(res["fused"], res["reference"]):
        assert ((got - want).norm() / want.norm()).item() < 1e-4
