"""Sinkhorn-Knopp as one autograd node: the same projection as `kernels.sinkhorn.sinkhorn`, with a hand-written
backward that recomputes the iterates from the saved logits (mhc.md §3: only the logits are kept).

Shape letters: B matrices (tokens, flattened leading dims), n streams.

Why: autograd through the unrolled loop records 3 ops per half-round (sum, add, divide over [B, n, n]), i.e.
120 forward ops and as many backward nodes for 20 rounds, all of them tiny. On a CPU each costs microseconds of
dispatch whatever its size, so at n = 4 the projection was most of an mHC sub-layer's time. Here the rounds run
as diagonal scalings of one base matrix (two small ops per half-round, no autograd recording), and the backward
walks the same recurrence in reverse.

The recurrence (layout of mhc.md §2.1, columns first, eps e = 0 for the 'exp' form):
    P = softmax over the column (dim -2) of the logits;  A = P + e ('softmax' form) or P ('exp' form)
    r_0 = 1, c_1 = 1, then for k = 1..iters:
        c_k = c_{k-1} / (c_{k-1} * (A^T r_{k-1}) + e)      (k >= 2: T_c)
        r_k = r_{k-1} / (r_{k-1} * (A c_k) + e)             (T_r)
    H = diag(r_iters) A diag(c_iters)
which is exactly what the reference computes entry by entry (its first T_c is the column softmax, its first T_r
scales the rows of A), so values and gradients agree to rounding (tests/kernels/test_sinkhorn_node.py: fp64 to
1e-12 in relative norm, for both forms and 1, 2 and 20 rounds).

Backward, with d/dr of r / (r q + e) = e / (r q + e)^2 and d/dq = -(r / (r q + e))^2:
    dq_k = -r_k^2 dr_k;  dr_{k-1} = e (r_k / r_{k-1})^2 dr_k + A ds_k;  dc_k += A^T dq_k
    ds_k = -c_k^2 dc_k;  dc_{k-1} = e (c_k / c_{k-1})^2 dc_k
    dA = G * (r c^T) + sum_k dq_k c_k^T + sum_{k>=2} r_{k-1} ds_k^T   (two batched products at the end)
then the column softmax's backward. The backward is once-differentiable (a second derivative raises).
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .sinkhorn import SINKHORN_FORMS


def _base(logits: torch.Tensor, form: str, e: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, P): the matrix the rounds scale, and the column softmax it comes from."""
    p = torch.softmax(logits, dim=-2)
    return (p + e if form == "softmax" else p), p


def _iterates(a: torch.Tensor, at: torch.Tensor, iters: int, e: float):
    """The scalings r_1..r_iters and c_1..c_iters, each [B, n, 1] (c_1 = 1)."""
    ones = a.new_ones(a.shape[0], a.shape[1], 1)
    rs, cs = [], [ones]
    if e == 0.0:
        r = a.sum(-1, keepdim=True).reciprocal_()
        rs.append(r)
        for _ in range(iters - 1):
            c = torch.bmm(at, r).reciprocal_()
            r = torch.bmm(a, c).reciprocal_()
            cs.append(c)
            rs.append(r)
        return rs, cs
    r = a.sum(-1, keepdim=True).add_(e).reciprocal_()
    rs.append(r)
    c = ones
    for _ in range(iters - 1):
        c = torch.bmm(at, r).add_(e / c).reciprocal_()  # c / (c s + e) = 1 / (s + e / c)
        r = torch.bmm(a, c).add_(e / r).reciprocal_()
        cs.append(c)
        rs.append(r)
    return rs, cs


class _SinkhornNode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, iters: int, form: str, e: float) -> torch.Tensor:
        a, _ = _base(logits, form, e)
        rs, cs = _iterates(a, a.transpose(1, 2).contiguous(), iters, e)
        ctx.save_for_backward(logits)
        ctx.args = (iters, form, e)
        return rs[-1] * a * cs[-1].transpose(1, 2)

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):
        (logits,) = ctx.saved_tensors
        iters, form, e = ctx.args
        a, p = _base(logits, form, e)
        at = a.transpose(1, 2).contiguous()  # bmm runs faster on a contiguous A^T
        rs, cs = _iterates(a, at, iters, e)
        r, c = rs[-1], cs[-1]
        r_sq, c_sq = (torch.stack(rs) ** 2).unbind(0), (torch.stack(cs) ** 2).unbind(0)
        if e != 0.0:  # d r_k / d r_{k-1} = e (r_k / r_{k-1})^2, the same for c
            r_e, c_e = (e / torch.stack(rs) ** 2).unbind(0), (e / torch.stack(cs) ** 2).unbind(0)
        g = g.contiguous()
        ga = g * a
        # signs folded: u_k = -dq_k = r_k^2 dr_k; ds_k = c_k^2 (A^T u_k - dc_k^in); m = -dc^in
        u = r_sq[-1] * torch.bmm(ga, c)
        m = torch.bmm(ga.transpose(1, 2), r).neg_()
        us, dss = [None] * iters, [None] * (iters - 1)
        us[-1] = u
        for k in range(iters - 1, 0, -1):  # index k holds r_{k+1}, c_{k+1}; the round k+1 >= 2 has a T_c
            t = torch.bmm(at, u) if m is None else torch.baddbmm(m, at, u)
            ds = t.mul_(c_sq[k])
            dss[k - 1] = ds
            dr = torch.bmm(a, ds)
            if e != 0.0:
                dr.addcmul_(r_e[k - 1], u)
                m = c_e[k - 1] * ds
            else:  # e = 0: c_k does not depend on c_{k-1}
                m = None
            u = dr.mul_(r_sq[k - 1])
            us[k - 1] = u
        # dA = G * (r c^T) + sum_k dq_k c_k^T + sum_{k>=2} r_{k-1} ds_k^T, dq = -u
        da = g * (r * c.transpose(1, 2))
        da.baddbmm_(torch.cat(us, dim=2), torch.cat(cs, dim=2).transpose(1, 2), alpha=-1.0)
        if iters > 1:
            da.baddbmm_(torch.cat(rs[:-1], dim=2), torch.cat(dss, dim=2).transpose(1, 2))
        dlogits = p * (da - (da * p).sum(-2, keepdim=True))  # column softmax backward
        return dlogits, None, None, None


def sinkhorn_node(logits: torch.Tensor, iters: int = 20, form: str = "exp", eps: float = 1e-6) -> torch.Tensor:
    """`kernels.sinkhorn.sinkhorn` (same signature, same result) as one autograd node: logits [..., n, n]."""
    if form not in SINKHORN_FORMS:
        raise ValueError(f"sinkhorn_form={form!r} is unknown; choose 'exp' or 'softmax'")
    if iters < 1:
        raise ValueError(f"sinkhorn_iters={iters} must be >= 1")
    if logits.dim() < 2 or logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"sinkhorn logits must be square in the last two dims, got {tuple(logits.shape)}")
    n = logits.shape[-1]
    flat = logits.reshape(-1, n, n)
    out = _SinkhornNode.apply(flat, iters, form, float(eps) if form == "softmax" else 0.0)
    return out.view(logits.shape)
