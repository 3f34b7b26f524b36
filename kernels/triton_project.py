"""Triton kernel 1: projection + sum of squares in one scan of x (norm after matmul, mhc.md §2.2).

Rows R (T tokens for mhc, T*n streams for hc), K = row width (n*C or C), m = projection width (small).
Forward: mix = A @ phi (fp32 accumulate), sumsq = sum(A^2), split over K so a short T still fills the GPU;
partials are summed by the caller (deterministic, no atomics).
Backward: one read of A gives both dA = dmix @ phi^T + 2 A dsumsq (+ the pre read's H_pre (x) dlin term, so
the sub-layer's dx is written once) and the partial dphi = A^T dmix per row split.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def project_fwd_kernel(a_ptr, w_ptr, mix_ptr, ss_ptr, R, K, M, K_PER_SPLIT,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
                       PRECISION: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_s = tl.program_id(1)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    mm = tl.arange(0, BLOCK_M)
    rm = r < R
    mmask = mm < M
    acc = tl.zeros([BLOCK_R, BLOCK_M], dtype=tl.float32)
    ss = tl.zeros([BLOCK_R], dtype=tl.float32)
    k_lo = pid_s * K_PER_SPLIT
    for k0 in range(k_lo, k_lo + K_PER_SPLIT, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = (k < K) & (k < k_lo + K_PER_SPLIT)
        a = tl.load(a_ptr + r[:, None] * K + k[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        a = a.to(tl.float32)
        w = tl.load(w_ptr + k[:, None] * M + mm[None, :], mask=km[:, None] & mmask[None, :], other=0.0)
        acc += tl.dot(a, w, input_precision=PRECISION)
        ss += tl.sum(a * a, axis=1)
    base = pid_s * R
    tl.store(mix_ptr + (base + r[:, None]) * M + mm[None, :], acc, mask=rm[:, None] & mmask[None, :])
    tl.store(ss_ptr + base + r, ss, mask=rm)


@triton.jit
def project_bwd_kernel(a_ptr, w_ptr, dmix_ptr, dss_ptr, hpre_ptr, dlin_ptr, da_ptr, dw_ptr,
                       R, K, M, C, R_PER_SPLIT, N: tl.constexpr, HAS_PRE: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
                       PRECISION: tl.constexpr):
    pid_k = tl.program_id(0)
    pid_s = tl.program_id(1)
    k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mm = tl.arange(0, BLOCK_M)
    km = k < K
    mmask = mm < M
    w = tl.load(w_ptr + k[:, None] * M + mm[None, :], mask=km[:, None] & mmask[None, :], other=0.0)
    dw = tl.zeros([BLOCK_K, BLOCK_M], dtype=tl.float32)
    r_lo = pid_s * R_PER_SPLIT
    for r0 in range(r_lo, r_lo + R_PER_SPLIT, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        rm = (r < R) & (r < r_lo + R_PER_SPLIT)
        rk = rm[:, None] & km[None, :]
        a = tl.load(a_ptr + r[:, None] * K + k[None, :], mask=rk, other=0.0).to(tl.float32)
        g = tl.load(dmix_ptr + r[:, None] * M + mm[None, :], mask=rm[:, None] & mmask[None, :], other=0.0)
        dss = tl.load(dss_ptr + r, mask=rm, other=0.0)
        da = tl.dot(g, tl.trans(w), input_precision=PRECISION) + 2.0 * a * dss[:, None]
        if HAS_PRE:
            # Row width K = N*C with k = j*C + c: add H_pre[r, j] * dlin[r, c] (the pre read's dx).
            hp = tl.load(hpre_ptr + r[:, None] * N + (k // C)[None, :], mask=rk, other=0.0)
            dl = tl.load(dlin_ptr + r[:, None] * C + (k % C)[None, :], mask=rk, other=0.0).to(tl.float32)
            da += hp * dl
        tl.store(da_ptr + r[:, None] * K + k[None, :], da.to(da_ptr.dtype.element_ty), mask=rk)
        dw += tl.dot(tl.trans(a), g, input_precision=PRECISION)
    tl.store(dw_ptr + (pid_s * K + k[:, None]) * M + mm[None, :], dw, mask=km[:, None] & mmask[None, :])
