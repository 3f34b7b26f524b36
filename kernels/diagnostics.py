"""Stability diagnostics read by the runtime: composite gain over depth and stream collapse.

Shape letters: L layers (sub-layers), T tokens, n streams (N for a variant's full stream count, e.g. xHC's 16),
C hidden.
With x_{l+1} = H_res,l x_l, the residual path through L layers is P = H_{L-1} ... H_1 H_0. Its forward
Amax gain is the max absolute row sum of P (infinity norm) and its backward gain the max absolute column
sum (1-norm), mHC §5.4 / Fig. 7.

Stream collapse (LSS, arXiv 2606.03483; mhc.md §3): H_res stays near the identity in deep layers, the read
(H_pre) and write (H_post) weights concentrate on one stream, and the norm accumulates in that stream.
`layer_stats` measures all three for one sub-layer from a `View` of its coefficients:

- stream_rms[i] = sqrt(mean_{t,c} x[t, i, c]^2) of the state entering the sub-layer; imbalance = max / min.
- read_share[i] = mean_t |read[t, i]| / sum_j |read[t, j]| (HC weights can be negative, hence |.|); the
  same for write. 1/N everywhere is uniform, 1 on one stream is full concentration.
- res_identity_dist = mean_t ||H_res[t] - I||_F: 0 for the identity, 2 for a swap of two streams.
- gain_fwd / gain_bwd = max_t of the single-layer Amax gains of H_res[t]; res_mean = mean_t H_res[t].
"""
from __future__ import annotations

from typing import Any, NamedTuple

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


class View(NamedTuple):
    """What a residual variant exposes per sub-layer for the tokens of one micro-batch (N streams).

    read [T, N]: input-mixing weights (H_pre). write [T, N]: write-back weights (H_post; xHC: p * the sum over
    components scattered to the active streams, 0 on inactive ones). res [T, N, N]: H_res, to i from j (xHC: the
    k x k active block embedded with the identity on inactive streams).
    """

    read: torch.Tensor
    write: torch.Tensor
    res: torch.Tensor


def mhc_view(coeffs: Any) -> View:
    """The View of `kernels.module.Coefficients` (h_pre, h_post, h_res) of variants hc, mhc and mhc-lite."""
    view = View(read=coeffs.h_pre, write=coeffs.h_post, res=coeffs.h_res)
    _check_view(view)
    return view


def _check_view(view: View) -> tuple[int, int]:
    read, write, res = view
    if read.dim() != 2:
        raise ValueError(f"view.read must be [T, N], got {tuple(read.shape)}")
    t, n = read.shape
    if tuple(write.shape) != (t, n):
        raise ValueError(f"view.write must be [T, N] = [{t}, {n}] like view.read, got {tuple(write.shape)}")
    if tuple(res.shape) != (t, n, n):
        raise ValueError(f"view.res must be [T, N, N] = [{t}, {n}, {n}], got {tuple(res.shape)}")
    return t, n


def imbalance_ratio(norms: torch.Tensor) -> float:
    """max / min of per-stream norms [N] as a float: inf when one stream is exactly zero and another is not, 1 when
    all are zero (nothing is unbalanced)."""
    lo, hi = norms.min(), norms.max()
    return float(hi / lo) if lo > 0 else (float("inf") if hi > 0 else 1.0)


def _shares(w: torch.Tensor) -> torch.Tensor:
    """Token mean of |w| / sum_j |w_j| for w [T, N] (fp64); an all-zero token contributes zeros, not NaN."""
    a = w.abs()
    return (a / a.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)).mean(dim=0)


def layer_stats(x: torch.Tensor, view: View) -> dict:
    """Collapse statistics of one sub-layer: x [T, N, C] is the residual state entering it (see module doc).

    Returns plain floats and lists (JSON-ready), all computed in float64: stream_rms [N], imbalance, read_share
    [N], write_share [N], res_identity_dist, gain_fwd, gain_bwd, res_mean [N][N]. imbalance is inf when one
    stream is exactly zero and another is not.
    """
    t, n = _check_view(view)
    if x.dim() != 3 or x.shape[0] != t or x.shape[1] != n:
        raise ValueError(f"x must be [T, N, C] = [{t}, {n}, C] like the view, got {tuple(x.shape)}")
    if t == 0:
        raise ValueError("the view has no tokens (T = 0); log a micro-batch that has tokens")
    f64 = torch.float64
    with torch.no_grad():
        rms = x.detach().to(f64).pow(2).mean(dim=(0, 2)).sqrt()
        imbalance = imbalance_ratio(rms)
        res = view.res.detach().to(f64)
        eye = torch.eye(n, dtype=f64, device=res.device)
        gain = amax_gain(res)
        return {
            "stream_rms": rms.tolist(),
            "imbalance": imbalance,
            "read_share": _shares(view.read.detach().to(f64)).tolist(),
            "write_share": _shares(view.write.detach().to(f64)).tolist(),
            "res_identity_dist": float(torch.linalg.matrix_norm(res - eye).mean()),
            "gain_fwd": float(gain.forward.max()),
            "gain_bwd": float(gain.backward.max()),
            "res_mean": res.mean(dim=0).tolist(),
        }
