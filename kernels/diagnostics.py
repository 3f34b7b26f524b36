"""Stability diagnostics read by the runtime: composite gain over depth and stream collapse.

Shape letters: L layers (sub-layers), T tokens, n streams, C hidden.
With x_{l+1} = H_res,l x_l, the residual path through L layers is P = H_{L-1} ... H_1 H_0. Its forward
Amax gain is the max absolute row sum of P (infinity norm) and its backward gain the max absolute column
sum (1-norm), mHC §5.4 / Fig. 7.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Gain(NamedTuple):
    forward: torch.Tensor  # max_i sum_j |P[i, j]|, shape [...] (batch dims of the input)
    backward: torch.Tensor  # max_j sum_i |P[i, j]|


def composite(h_res: torch.Tensor) -> torch.Tensor:
    """P = H_{L-1} @ ... @ H_0 for h_res [L, ..., n, n] (layer 0 first); computed in fp64."""
    if h_res.dim() < 3 or h_res.shape[-1] != h_res.shape[-2]:
        raise ValueError(f"h_res must be [L, ..., n, n] (layer first), got {tuple(h_res.shape)}")
    p = torch.eye(h_res.shape[-1], dtype=torch.float64, device=h_res.device).expand(h_res.shape[1:]).clone()
    for h in h_res.to(torch.float64):
        p = h @ p
    return p


def amax_gain(m: torch.Tensor) -> Gain:
    """Forward (max abs row sum) and backward (max abs column sum) gain of m [..., n, n]."""
    a = m.abs()
    return Gain(forward=a.sum(dim=-1).amax(dim=-1), backward=a.sum(dim=-2).amax(dim=-1))


def composite_gain(h_res: torch.Tensor) -> Gain:
    """Amax gains of the product of h_res [L, ..., n, n] over depth."""
    return amax_gain(composite(h_res))


class StreamStats(NamedTuple):
    norms: torch.Tensor  # [n] RMS of each stream over tokens and channels
    imbalance: torch.Tensor  # max / min stream RMS; 1 is balanced, large means one stream dominates


def stream_imbalance(x: torch.Tensor) -> StreamStats:
    """Per-stream norm imbalance of the residual state x [T, n, C] (stream collapse, arXiv 2606.03483)."""
    if x.dim() != 3:
        raise ValueError(f"x must be [T, n, C], got shape {tuple(x.shape)}")
    norms = x.detach().to(torch.float64).pow(2).mean(dim=(0, 2)).sqrt()
    return StreamStats(norms=norms, imbalance=norms.max() / norms.min().clamp_min(torch.finfo(torch.float64).tiny))
