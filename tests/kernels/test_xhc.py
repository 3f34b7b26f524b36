"""xHC (kernels.xhc): reduction to mHC, routing, Sinkhorn block, augmentation, write-back, Flash, recompute."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from kernels import MHCConfig, MHCSublayer
from kernels.xhc import XHCSublayer, causal_depthwise, gram_schmidt, route, write_back


def _mlp(c: int) -> nn.Module:
    return nn.Sequential(nn.Linear(c, 2 * c), nn.Tanh(), nn.Linear(2 * c, c))


def _layer(n=6, k=3, fixed=1, c=8, seq_len=4, mlp=True, seed=0, **kw) -> XHCSublayer:
    torch.manual_seed(seed)
    cfg = MHCConfig(variant="xhc", n=n, active=k, fixed=fixed, **kw)
    m = XHCSublayer(cfg, _mlp(c), c, seq_len=seq_len, mlp=mlp).double()
    with torch.no_grad():  # away from init so every coefficient path carries signal
        m.alpha.fill_(1.0)
        m.bias_full.normal_()
        m.bias_act.normal_()
        for w in m.conv:
            w.normal_(0.0, 0.5)
    return m


@pytest.mark.parametrize("form", ["exp", "softmax"])
def test_reduces_to_mhc_exactly(form):
    n, c = 4, 8
    x_cfg = dict(n=n, sinkhorn_form=form, sinkhorn_iters=20)
    m = _layer(mlp=True, c=c, k=n, fixed=n, augment="none", **x_cfg)
    ref = MHCSublayer(MHCConfig(variant="mhc", backend="reference", **x_cfg), m.sublayer, c).double()
    with torch.no_grad():
        ref.phi.copy_(torch.cat([m.phi_full[:, n:], m.phi_act], 1))
        ref.alpha.copy_(m.alpha[:3])
        ref.bias.copy_(torch.cat([m.bias_full[n:], m.bias_act]))
        m.phi_full[:, :n] = float("nan")  # the router is unused without routed slots
    x = torch.randn(12, n, c, dtype=torch.float64)
    co, co_ref = m.coefficients(x), ref.coefficients(x)
    assert torch.equal(co.idx, torch.arange(n).expand(12, n)) and torch.equal(co.gate, torch.ones(12, n).double())
    for a, b in [(co.h_pre, co_ref.h_pre), (co.h_post[..., 0], co_ref.h_post), (co.h_res, co_ref.h_res)]:
        assert (a - b).abs().max() < 1e-13
    assert (m(x) - ref(x)).abs().max() < 1e-12


def test_inactive_streams_bit_identical():
    m = _layer(n=7, k=3, fixed=1, aug_kernels=(2, 3))
    x = torch.randn(8, 7, 8, dtype=torch.float64)
    co = m.coefficients(x)
    out = m(x)
    active = torch.zeros(8, 7, dtype=torch.bool).scatter(1, co.idx, True)
    assert torch.equal(out[~active], x[~active])
    assert (out[active] - x[active]).abs().amax(-1).min() > 1e-3  # every active stream is rewritten
    assert len(set(map(tuple, co.idx[:, 1:].tolist()))) > 1  # routing differs between tokens


def test_sinkhorn_on_active_block_is_doubly_stochastic():
    m = _layer(n=8, k=4, fixed=2, sinkhorn_iters=300)
    h = m.coefficients(torch.randn(10, 8, 8, dtype=torch.float64)).h_res
    assert h.shape == (10, 4, 4) and (h >= 0).all()
    assert (h.sum(-1) - 1).abs().max() < 1e-14 and (h.sum(-2) - 1).abs().max() < 1e-9


def test_projections_by_hand():
    m = _layer(n=6, k=3, fixed=1, aug_kernels=(2,))
    x = torch.randn(4, 6, 8, dtype=torch.float64)
    co = m.coefficients(x)
    a, eps = m.alpha, m.config.rms_eps
    for t in range(4):
        v, va = x[t].flatten(), x[t, co.idx[t]].flatten()  # rms over N*C for the read, k*C for the write
        h_pre = torch.sigmoid(a[0] * (v @ m.phi_full[:, 6:]) / (v.pow(2).mean() + eps).sqrt() + m.bias_full[6:])
        lg = a[1] * (va @ m.phi_act[:, :6]) / (va.pow(2).mean() + eps).sqrt() + m.bias_act[:6]
        assert (co.h_pre[t] - h_pre).abs().max() < 1e-14
        assert (co.h_post[t] - 2 * torch.sigmoid(lg).view(3, 2)).abs().max() < 1e-14


def test_augmentation_is_causal_within_sequences():
    m = _layer(n=5, k=3, fixed=1, c=6, seq_len=5, aug_kernels=(2, 4))
    x = torch.randn(15, 5, 6, dtype=torch.float64)
    out = m(x)
    for s in (4, 7):  # last token of sequence 0; a middle token of sequence 1
        x2 = x.clone()
        x2[s] += torch.randn(5, 6, dtype=torch.float64)
        out2 = m(x2)
        seq = s // 5
        same = [t for t in range(15) if t < s or t // 5 != seq]
        assert torch.equal(out2[same], out[same])
        later = [t for t in range(s, 15) if t // 5 == seq]
        for t in later[: 4]:  # kernel 4 reaches 3 tokens ahead
            assert (out2[t] - out[t]).abs().max() > 1e-6, t
    y = torch.randn(6, 3, dtype=torch.float64)
    w = torch.randn(3, 2, dtype=torch.float64)
    want = y * w[:, 1]
    want[[1, 2, 4, 5]] += y[[0, 1, 3, 4]] * w[:, 0]
    assert torch.allclose(causal_depthwise(y, w, 3), want, rtol=0, atol=1e-15)


def test_gram_schmidt_orthogonal_unnormalised():
    torch.manual_seed(4)
    comp = torch.randn(9, 4, 16, dtype=torch.float64)
    q = gram_schmidt(comp)
    assert torch.equal(q[:, 0], comp[:, 0])
    gram = q @ q.transpose(1, 2)
    norms = gram.diagonal(dim1=1, dim2=2).sqrt()
    off = (gram / (norms[:, :, None] * norms[:, None, :]) - torch.eye(4, dtype=torch.float64)).abs()
    assert off.max() < 1e-12
    # Unnormalised GS is Q diag(R) of the QR factorisation of the columns [c_0 .. c_3].
    qr_q, qr_r = torch.linalg.qr(comp.transpose(1, 2))
    want = (qr_q * qr_r.diagonal(dim1=1, dim2=2)[:, None, :]).transpose(1, 2)
    assert ((q - want).norm() / want.norm()) < 1e-12


def test_topk_routing():
    torch.manual_seed(5)
    scores = torch.rand(20, 9, dtype=torch.float64)
    idx, gate = route(scores, k=5, fixed=2)
    for t in range(20):
        top = sorted((torch.argsort(scores[t, 2:], descending=True)[:3] + 2).tolist())
        assert idx[t].tolist() == [0, 1] + top
        assert gate[t].tolist() == [1.0, 1.0] + scores[t, top].tolist()
    m = _layer(n=6, k=4, fixed=2)
    with torch.no_grad():  # the router bias makes streams 5 and 3 win for every token
        m.bias_full[:6] = torch.tensor([0.0, 0.0, -30.0, 30.0, -30.0, 30.0])
    co = m.coefficients(torch.randn(7, 6, 8, dtype=torch.float64))
    assert torch.equal(co.idx, torch.tensor([0, 1, 3, 5]).expand(7, 4))
    assert torch.equal(co.gate[:, :2], torch.ones(7, 2).double()) and (co.gate[:, 2:] > 0.99).all()


@pytest.fixture
def one_thread():
    # gradcheck runs ~1000 tiny forwards; intra-op threads only add contention at these sizes.
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def test_gradcheck_forward_wrt_x_and_parameters(one_thread):
    m = _layer(n=5, k=3, fixed=1, c=4, seq_len=3, aug_kernels=(2, 3), seed=6, sinkhorn_iters=4)
    x = torch.randn(6, 5, 4, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():  # TopK is piecewise constant: the finite differences must not cross a tie
        v = x.reshape(6, 20)
        rinv = torch.rsqrt((v * v).mean(-1, keepdim=True) + m.config.rms_eps)
        s = (rinv * m.alpha[3] * (v @ m.phi_full[:, :5]) + m.bias_full[:5])[:, 1:].sort(-1, descending=True).values
        assert (s[:, 1] - s[:, 2]).min() > 1e-3
    names = [n for n, _ in m.named_parameters() if not n.startswith("sublayer.")]
    params = {n: p.detach().clone().requires_grad_() for n, p in m.named_parameters() if n in names}

    def f(x, *ps):
        return functional_call(m, dict(zip(names, ps)), (x,))

    assert torch.autograd.gradcheck(f, (x, *params.values()), eps=1e-6, atol=1e-8, rtol=1e-6)
    f(x, *params.values()).pow(2).sum().backward()
    assert params["phi_full"].grad[:, :5].abs().sum() > 0  # router gradient through the gate p
    assert all(params[n].grad.abs().sum() > 0 for n in names)


def test_flash_reuses_attention_routing():
    torch.manual_seed(7)
    cfg = MHCConfig(variant="xhc", n=6, active=4, fixed=2, flash=True, aug_kernels=(2,))
    attn = XHCSublayer(cfg, nn.Identity(), 8, seq_len=2, mlp=False).double()
    mlp = XHCSublayer(cfg, _mlp(8), 8, seq_len=2, mlp=True).double()
    x = torch.randn(6, 6, 8, dtype=torch.float64)
    c_attn = attn.coefficients(x)
    x2 = attn(x)
    co = mlp.coefficients(x2, routing=c_attn)
    assert co.idx is c_attn.idx and co.gate is c_attn.gate
    assert co.h_post.shape == (6, 4, 2) and not torch.equal(co.h_pre, c_attn.h_pre)
    out = mlp(x2, routing=c_attn)
    with torch.no_grad():  # the router is not needed: poisoning it changes nothing
        mlp.phi_full[:, :6] = float("nan")
        mlp.bias_full[:6] = float("nan")
        mlp.alpha[3] = float("nan")
    assert torch.equal(mlp(x2, routing=c_attn), out)
    with pytest.raises(ValueError, match="routing"):
        mlp(x2)
    with pytest.raises(ValueError, match="routing"):
        attn(x, routing=c_attn)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_forward_equals_recompute_pieces(dtype):
    m = _layer(n=6, k=4, fixed=2, seq_len=3, aug_kernels=(2, 3)).float()
    x = torch.randn(9, 6, 8).to(dtype)
    if dtype != torch.bfloat16:
        m = m.to(dtype)
    else:
        m.sublayer.to(dtype)
    co = m.coefficients(x)
    y = m.sublayer(m.apply_pre(x, co))
    out = m(x)
    assert torch.equal(out, m.apply_post_res(x, y, co)) and torch.equal(out, m.apply_post_res(x, y.clone(), co))
    assert torch.equal(out, write_back(x, m.augment(y), co))
    assert out.dtype == dtype and co.h_res.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert co.h_post.shape == (9, 4, 3) and co.idx.dtype == torch.long and m.phi_act.dtype != torch.bfloat16


def test_diagnostic_view_reproduces_write_back_without_augmentation():
    m = _layer(n=6, k=3, fixed=1, augment="none")
    x = torch.randn(5, 6, 8, dtype=torch.float64)
    co = m.coefficients(x)
    y = m.sublayer(m.apply_pre(x, co))
    view = m.diagnostic_view(co)
    want = view.res @ x + view.write[:, :, None] * y[:, None]
    assert (m.apply_post_res(x, y, co) - want).abs().max() < 1e-13
    inactive = torch.ones(5, 6, dtype=torch.bool).scatter(1, co.idx, False)
    assert (view.write[inactive] == 0).all() and torch.equal(view.read, co.h_pre)
    assert torch.allclose(view.res.sum(-1), torch.ones(5, 6, dtype=torch.float64), atol=1e-14)


def test_bad_inputs_raise_one_line_value_errors():
    m = _layer(n=6, k=3, fixed=1, seq_len=4)
    bad = [
        (lambda: m(torch.randn(8, 5, 8).double()), r"^x must be \[T, N, C\]"),
        (lambda: m(torch.randn(6, 6, 8).double()), "not a multiple of seq_len=4"),
        (lambda: m.apply_post_res(torch.randn(8, 6, 8).double(), torch.randn(8, 7).double(),
                                  m.coefficients(torch.randn(8, 6, 8).double())), "^y "),
        (lambda: causal_depthwise(torch.randn(5, 3), torch.randn(3, 2), 2), "seq_len=2"),
        (lambda: XHCSublayer(MHCConfig(n=4), nn.Identity(), 8, seq_len=4, mlp=True), "variant"),
        (lambda: route(torch.rand(3, 4), k=5, fixed=1), "fixed"),
    ]
    for call, pattern in bad:
        with pytest.raises(ValueError, match=pattern) as err:
            call()
        assert "\n" not in str(err.value)
    # Attention sub-layers do not convolve: any T is fine.
    _layer(n=6, k=3, fixed=1, seq_len=4, mlp=False)(torch.randn(6, 6, 8).double())
