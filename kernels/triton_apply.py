"""Triton kernels 4 and 5: the pre read (H_pre x) and the post+res write merged with the residual.

Shape letters: T tokens, n streams (NP = next power of two), C hidden. Streams are read in their dtype
(bf16 on GPU) and accumulated in fp32; coefficients are fp32. Each program owns BLOCK_T tokens and walks C,
so the per-token coefficient gradients reduce on-chip without atomics (deterministic).
Importing this module imports triton; kernels/fused.py imports it lazily.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pre_fwd_kernel(x_ptr, h_ptr, out_ptr, T, C, N: tl.constexpr, NP: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, NP)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    tm = t < T
    jm = j < N
    cm = c < C
    h = tl.load(h_ptr + t[:, None] * N + j[None, :], mask=tm[:, None] & jm[None, :], other=0.0)
    offs = (t[:, None, None] * N + j[None, :, None]) * C + c[None, None, :]
    m3 = tm[:, None, None] & jm[None, :, None] & cm[None, None, :]
    x = tl.load(x_ptr + offs, mask=m3, other=0.0).to(tl.float32)
    out = tl.sum(h[:, :, None] * x, axis=1)
    tl.store(out_ptr + t[:, None] * C + c[None, :], out.to(out_ptr.dtype.element_ty),
             mask=tm[:, None] & cm[None, :])


@triton.jit
def pre_bwd_kernel(x_ptr, h_ptr, dout_ptr, dx_ptr, dh_ptr, T, C, N: tl.constexpr, NP: tl.constexpr,
                   WRITE_DX: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """dH_pre[t, j] = <dout[t], x[t, j]>; dx[t, j] = H_pre[t, j] dout[t] (skipped when the caller folds it
    into the projection backward, so dx is written once)."""
    pid_t = tl.program_id(0)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, NP)
    tm = t < T
    jm = j < N
    tj = tm[:, None] & jm[None, :]
    h = tl.load(h_ptr + t[:, None] * N + j[None, :], mask=tj, other=0.0)
    dh = tl.zeros([BLOCK_T, NP], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        cm = c < C
        offs = (t[:, None, None] * N + j[None, :, None]) * C + c[None, None, :]
        m3 = tj[:, :, None] & cm[None, None, :]
        g = tl.load(dout_ptr + t[:, None] * C + c[None, :], mask=tm[:, None] & cm[None, :], other=0.0)
        g = g.to(tl.float32)
        x = tl.load(x_ptr + offs, mask=m3, other=0.0).to(tl.float32)
        dh += tl.sum(x * g[:, None, :], axis=2)
        if WRITE_DX:
            tl.store(dx_ptr + offs, (h[:, :, None] * g[:, None, :]).to(dx_ptr.dtype.element_ty), mask=m3)
    tl.store(dh_ptr + t[:, None] * N + j[None, :], dh, mask=tj)


@triton.jit
def post_res_fwd_kernel(x_ptr, y_ptr, hpost_ptr, hres_ptr, out_ptr, T, C, N: tl.constexpr, NP: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, NP)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    tm = t < T
    jm = j < N
    cm = c < C
    tc = tm[:, None] & cm[None, :]
    m3 = tm[:, None, None] & jm[None, :, None] & cm[None, None, :]
    x = tl.load(x_ptr + (t[:, None, None] * N + j[None, :, None]) * C + c[None, None, :], mask=m3, other=0.0)
    x = x.to(tl.float32)
    y = tl.load(y_ptr + t[:, None] * C + c[None, :], mask=tc, other=0.0).to(tl.float32)
    for i in tl.static_range(N):
        hr = tl.load(hres_ptr + (t[:, None] * N + i) * N + j[None, :], mask=tm[:, None] & jm[None, :], other=0.0)
        hp = tl.load(hpost_ptr + t * N + i, mask=tm, other=0.0)
        acc = tl.sum(hr[:, :, None] * x, axis=1) + hp[:, None] * y
        tl.store(out_ptr + (t[:, None] * N + i) * C + c[None, :], acc.to(out_ptr.dtype.element_ty), mask=tc)


@triton.jit
def post_res_bwd_kernel(x_ptr, y_ptr, hpost_ptr, hres_ptr, dout_ptr, dx_ptr, dy_ptr, dhpost_ptr, dhres_ptr,
                        T, C, N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """One pass over (x, y, dout): dx = H_res^T dout, dy = H_post . dout, and the per-token coefficient
    gradients dH_post[i] = <dout[i], y>, dH_res[i, j] = <dout[i], x[j]> reduced on-chip."""
    pid_t = tl.program_id(0)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, NP)
    tm = t < T
    jm = j < N
    tj = tm[:, None] & jm[None, :]
    dhp = tl.zeros([BLOCK_T, NP], dtype=tl.float32)
    dhr = tl.zeros([BLOCK_T, NP, NP], dtype=tl.float32)  # [t, i, j]
    row = tl.arange(0, NP)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        cm = c < C
        tc = tm[:, None] & cm[None, :]
        m3 = tj[:, :, None] & cm[None, None, :]
        offs3 = (t[:, None, None] * N + j[None, :, None]) * C + c[None, None, :]
        x = tl.load(x_ptr + offs3, mask=m3, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + t[:, None] * C + c[None, :], mask=tc, other=0.0).to(tl.float32)
        dx = tl.zeros([BLOCK_T, NP, BLOCK_C], dtype=tl.float32)
        dy = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for i in tl.static_range(N):
            g = tl.load(dout_ptr + (t[:, None] * N + i) * C + c[None, :], mask=tc, other=0.0).to(tl.float32)
            hr = tl.load(hres_ptr + (t[:, None] * N + i) * N + j[None, :], mask=tj, other=0.0)
            hp = tl.load(hpost_ptr + t * N + i, mask=tm, other=0.0)
            dx += hr[:, :, None] * g[:, None, :]
            dy += hp[:, None] * g
            sel = (row == i)[None, :]
            dhp += tl.where(sel, tl.sum(g * y, axis=1)[:, None], 0.0)
            dhr += tl.where(sel[:, :, None], tl.sum(g[:, None, :] * x, axis=2)[:, None, :], 0.0)
        tl.store(dx_ptr + offs3, dx.to(dx_ptr.dtype.element_ty), mask=m3)
        tl.store(dy_ptr + t[:, None] * C + c[None, :], dy.to(dy_ptr.dtype.element_ty), mask=tc)
    tl.store(dhpost_ptr + t[:, None] * N + j[None, :], dhp, mask=tj)
    offs_r = (t[:, None, None] * N + row[None, :, None]) * N + j[None, None, :]
    tl.store(dhres_ptr + offs_r, dhr, mask=tj[:, :, None] & jm[None, None, :])
