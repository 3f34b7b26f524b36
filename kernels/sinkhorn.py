"""Sinkhorn-Knopp projection onto (approximately) doubly stochastic matrices, and the mHC-lite exact form.

Layout (mhc.md §2.1): M[..., i, j] is the weight from stream j to stream i. T_c makes every column sum to 1
(sum over i, dim -2), T_r every row (sum over j, dim -1). Each round is T_c then T_r, so rows end exact.
Plain autograd through this unrolled loop is the reference gradient the fused backward must reproduce.
"""
from __future__ import annotations

import itertools
import math

import torch

from .config import MHC_LITE_MAX_N

SINKHORN_FORMS = ("exp", "softmax")


def sinkhorn(logits: torch.Tensor, iters: int = 20, form: str = "exp", eps: float = 1e-6) -> torch.Tensor:
    """Project logits [..., n, n] with `iters` rounds of (T_c, T_r).

    form='exp' is mHC Eq. 9 (no eps). form='softmax' is the TK/MLM/V4 production form in our layout:
    column softmax + eps, then T_r, then iters-1 rounds of (T_c, T_r), all dividing by (sum + eps).
    """
    if form not in SINKHORN_FORMS:
        raise ValueError(f"sinkhorn_form={form!r} is unknown; choose 'exp' or 'softmax'")
    if iters < 1:
        raise ValueError(f"sinkhorn_iters={iters} must be >= 1")
    if logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"sinkhorn logits must be square in the last two dims, got {tuple(logits.shape)}")
    e = eps if form == "softmax" else 0.0
    # A per-column shift is cancelled exactly by the first T_c (and by softmax), so detaching it is exact.
    m = torch.exp(logits - logits.amax(dim=-2, keepdim=True).detach())
    m = m / m.sum(dim=-2, keepdim=True)
    if form == "softmax":
        m = m + e
    m = m / (m.sum(dim=-1, keepdim=True) + e)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-2, keepdim=True) + e)
        m = m / (m.sum(dim=-1, keepdim=True) + e)
    return m


_PERM_CACHE: dict[int, torch.Tensor] = {}


def permutation_matrices(n: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """All n! permutation matrices [n!, n, n], identity first; P_k[i, perm_k[i]] = 1 (stream perm_k[i] -> i)."""
    if n > MHC_LITE_MAX_N:
        raise ValueError(f"n={n}: mhc-lite enumerates n! permutations and supports n <= {MHC_LITE_MAX_N}")
    if n not in _PERM_CACHE:
        perms = list(itertools.permutations(range(n)))
        p = torch.zeros(len(perms), n, n, dtype=torch.float64)
        for k, perm in enumerate(perms):
            p[k, torch.arange(n), torch.tensor(perm)] = 1.0
        _PERM_CACHE[n] = p
    return _PERM_CACHE[n].to(dtype=dtype, device=device)


def permutation_mix(logits: torch.Tensor, n: int) -> torch.Tensor:
    """mHC-lite: H_res = sum_k softmax(logits)_k P_k, exactly doubly stochastic. logits [..., n!] -> [..., n, n]."""
    if logits.shape[-1] != math.factorial(n):
        raise ValueError(f"mhc-lite res logits need n! = {math.factorial(n)} entries, got {logits.shape[-1]}")
    w = torch.softmax(logits, dim=-1)
    return torch.einsum("...k,kij->...ij", w, permutation_matrices(n, w.dtype, w.device))
