"""Triton kernels 2+3 for mhc: scale, bias, sigmoids and Sinkhorn in one per-token pass, and its exact backward.

Shape letters: T tokens, n streams (NP = next power of two), mix width M = 2n + n^2 ([pre | post | res]).
Sinkhorn runs ITERS rounds of (T_c, T_r). Round 0's T_c divides by the plain sum and then adds EPS_ADD
(softmax + eps form); every other step divides by sum + EPS_DIV. The 'exp' form is EPS_ADD = EPS_DIV = 0.

Backward (mhc.md §4.4): nothing but the inputs is saved. For each round in reverse, the iterate entering
it is recomputed from the logits on-chip (O(ITERS^2) tiny steps, no n^2*ITERS history in memory), and
for each normalisation
  Y = X / d  =>  dX = (dY - sum_axis(dY * Y)) / d,
the exact gradient of the finite, eps-included iteration the forward ran. Reductions over T for d(alpha)
and d(bias) are written per program and summed by the caller (deterministic).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _round(x, q, valid, EPS_DIV, EPS_ADD):
    """Round q of Sinkhorn: T_c then T_r. Returns the round's output, T_c's output (before the eps add) and
    both denominators, which is everything the backward of the round needs."""
    dc = tl.sum(x, axis=1)[:, None, :] + tl.where(q == 0, 0.0, EPS_DIV)
    dc = tl.where(valid, dc, 1.0)
    xc = x / dc
    xa = tl.where(valid, xc + tl.where(q == 0, EPS_ADD, 0.0), 0.0)
    dr = tl.where(valid, tl.sum(xa, axis=2)[:, :, None] + EPS_DIV, 1.0)
    return xa / dr, xc, dc, dr


@triton.jit
def _load_logits(mix_ptr, ss_ptr, alpha_ptr, bias_ptr, t, T, inv_width, rms_eps,
                 N: tl.constexpr, NP: tl.constexpr):
    M: tl.constexpr = 2 * N + N * N
    j = tl.arange(0, NP)
    tm = t < T
    jm = j < N
    tj = tm[:, None] & jm[None, :]
    ss = tl.load(ss_ptr + t, mask=tm, other=0.0)
    # Padding tokens get rinv = 0 so their (zero) gradients stay finite even with rms_eps = 0.
    rinv = tl.where(tm, 1.0 / tl.sqrt(ss * inv_width + rms_eps), 0.0)
    raw_pre = tl.load(mix_ptr + t[:, None] * M + j[None, :], mask=tj, other=0.0)
    raw_post = tl.load(mix_ptr + t[:, None] * M + N + j[None, :], mask=tj, other=0.0)
    valid = tj[:, :, None] & jm[None, None, :]
    offs_res = 2 * N + j[:, None] * N + j[None, :]
    raw_res = tl.load(mix_ptr + t[:, None, None] * M + offs_res[None, :, :], mask=valid, other=0.0)
    return rinv, raw_pre, raw_post, raw_res, tj, valid


@triton.jit
def _sinkhorn_start(logit, valid):
    logit = tl.where(valid, logit, -1e30)
    cmax = tl.max(logit, axis=1)
    return tl.where(valid, tl.exp(logit - cmax[:, None, :]), 0.0)


@triton.jit
def coeffs_fwd_kernel(mix_ptr, ss_ptr, alpha_ptr, bias_ptr, hpre_ptr, hpost_ptr, hres_ptr,
                      T, inv_width, rms_eps, pre_eps, EPS_DIV, EPS_ADD,
                      N: tl.constexpr, NP: tl.constexpr, ITERS: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, NP)
    jm = j < N
    rinv, raw_pre, raw_post, raw_res, tj, valid = _load_logits(
        mix_ptr, ss_ptr, alpha_ptr, bias_ptr, t, T, inv_width, rms_eps, N, NP)
    a_pre = tl.load(alpha_ptr)
    a_post = tl.load(alpha_ptr + 1)
    a_res = tl.load(alpha_ptr + 2)
    b_pre = tl.load(bias_ptr + j, mask=jm, other=0.0)
    b_post = tl.load(bias_ptr + N + j, mask=jm, other=0.0)
    offs_res = 2 * N + j[:, None] * N + j[None, :]
    b_res = tl.load(bias_ptr + offs_res, mask=jm[:, None] & jm[None, :], other=0.0)
    h_pre = tl.sigmoid(rinv[:, None] * a_pre * raw_pre + b_pre[None, :]) + pre_eps
    h_post = 2.0 * tl.sigmoid(rinv[:, None] * a_post * raw_post + b_post[None, :])
    x = _sinkhorn_start(rinv[:, None, None] * a_res * raw_res + b_res[None, :, :], valid)
    for q in range(0, ITERS):
        x, _xc, _dc, _dr = _round(x, q, valid, EPS_DIV, EPS_ADD)
    tl.store(hpre_ptr + t[:, None] * N + j[None, :], h_pre, mask=tj)
    tl.store(hpost_ptr + t[:, None] * N + j[None, :], h_post, mask=tj)
    tl.store(hres_ptr + (t[:, None, None] * N + j[None, :, None]) * N + j[None, None, :], x, mask=valid)


@triton.jit
def coeffs_bwd_kernel(mix_ptr, ss_ptr, alpha_ptr, bias_ptr, dhpre_ptr, dhpost_ptr, dhres_ptr,
                      dmix_ptr, dss_ptr, dalpha_ptr, dbias_ptr,
                      T, inv_width, rms_eps, EPS_DIV, EPS_ADD,
                      N: tl.constexpr, NP: tl.constexpr, ITERS: tl.constexpr, BLOCK_T: tl.constexpr):
    M: tl.constexpr = 2 * N + N * N
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, NP)
    jm = j < N
    rinv, raw_pre, raw_post, raw_res, tj, valid = _load_logits(
        mix_ptr, ss_ptr, alpha_ptr, bias_ptr, t, T, inv_width, rms_eps, N, NP)
    a_pre = tl.load(alpha_ptr)
    a_post = tl.load(alpha_ptr + 1)
    a_res = tl.load(alpha_ptr + 2)
    b_pre = tl.load(bias_ptr + j, mask=jm, other=0.0)
    b_post = tl.load(bias_ptr + N + j, mask=jm, other=0.0)
    offs_res = 2 * N + j[:, None] * N + j[None, :]
    b_res = tl.load(bias_ptr + offs_res, mask=jm[:, None] & jm[None, :], other=0.0)

    s = tl.sigmoid(rinv[:, None] * a_pre * raw_pre + b_pre[None, :])
    g_pre = tl.load(dhpre_ptr + t[:, None] * N + j[None, :], mask=tj, other=0.0) * s * (1.0 - s)
    s = tl.sigmoid(rinv[:, None] * a_post * raw_post + b_post[None, :])
    g_post = 2.0 * tl.load(dhpost_ptr + t[:, None] * N + j[None, :], mask=tj, other=0.0) * s * (1.0 - s)

    x0 = _sinkhorn_start(rinv[:, None, None] * a_res * raw_res + b_res[None, :, :], valid)
    offs3 = (t[:, None, None] * N + j[None, :, None]) * N + j[None, None, :]
    g = tl.load(dhres_ptr + offs3, mask=valid, other=0.0)
    for kk in range(0, ITERS):
        k = ITERS - 1 - kk
        x = x0
        for q in range(0, k):
            x, _xc, _dc, _dr = _round(x, q, valid, EPS_DIV, EPS_ADD)
        y, xc, dc, dr = _round(x, k, valid, EPS_DIV, EPS_ADD)
        g = tl.where(valid, (g - tl.sum(g * y, axis=2)[:, :, None]) / dr, 0.0)  # through T_r
        g = tl.where(valid, (g - tl.sum(g * xc, axis=1)[:, None, :]) / dc, 0.0)  # through T_c (eps add: identity)
    g_res = g * x0  # d exp(l - colmax) / dl; the shift is cancelled by the first T_c

    tl.store(dmix_ptr + t[:, None] * M + j[None, :], g_pre * rinv[:, None] * a_pre, mask=tj)
    tl.store(dmix_ptr + t[:, None] * M + N + j[None, :], g_post * rinv[:, None] * a_post, mask=tj)
    tl.store(dmix_ptr + t[:, None, None] * M + offs_res[None, :, :], g_res * rinv[:, None, None] * a_res, mask=valid)

    c_pre = tl.sum(g_pre * raw_pre, axis=1)
    c_post = tl.sum(g_post * raw_post, axis=1)
    c_res = tl.sum(tl.sum(g_res * raw_res, axis=2), axis=1)
    drinv = a_pre * c_pre + a_post * c_post + a_res * c_res
    # rinv = (ss * inv_width + rms_eps)^(-1/2)  =>  d rinv / d ss = -rinv^3 * inv_width / 2
    tl.store(dss_ptr + t, -0.5 * drinv * rinv * rinv * rinv * inv_width, mask=t < T)

    tl.store(dalpha_ptr + pid * 3, tl.sum(c_pre * rinv, axis=0))
    tl.store(dalpha_ptr + pid * 3 + 1, tl.sum(c_post * rinv, axis=0))
    tl.store(dalpha_ptr + pid * 3 + 2, tl.sum(c_res * rinv, axis=0))
    tl.store(dbias_ptr + pid * M + j, tl.sum(g_pre, axis=0), mask=jm)
    tl.store(dbias_ptr + pid * M + N + j, tl.sum(g_post, axis=0), mask=jm)
    tl.store(dbias_ptr + pid * M + offs_res, tl.sum(g_res, axis=0), mask=jm[:, None] & jm[None, :])
