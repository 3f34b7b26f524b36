"""xHC, Expanded Hyper-Connections (arXiv 2607.14530; mhc.md §3): N streams, k of them active per token.

Shape letters: T tokens (B sequences of seq_len contiguous tokens, flattened), N streams (config.n), C hidden,
k active streams per token (config.k), K write-back components (K = r + 1 with r = len(aug_kernels) on
augmented MLP sub-layers, else 1), w a convolution kernel size. Conventions are mHC's (kernels.reference):
H_res[i, j] carries slot j into slot i; coefficient math in fp32 (fp64 for fp64 x); streams keep x's dtype.

Our definition (the paper's code is unreleased; this module is the project's truth):

1. Full-state projection, one read of X [T, N, C] (norm after matmul, as reference.project):
   logits = (alpha_g * vec(X) phi_full) / rms(vec(X)) + b_full, phi_full [N*C, 2N] = [router (N) | pre (N)],
   rms over the N*C vector with cfg.rms_eps. Router score r = sigmoid(router logits) [T, N]; the dense read
   H_pre = sigmoid(pre logits) (+ cfg.eps for sinkhorn_form 'softmax') covers all N streams:
   u = sum_j H_pre[j] X[j] -> [T, C], the sub-layer input.
2. Routing (`route`): slots 0..fixed-1 hold streams 0..fixed-1; the other k - fixed slots hold the TopK router
   scores among streams fixed..N-1, in ascending stream index. idx [T, k]; gate p [T, k] = 1 on fixed slots and
   r on routed ones, so the router gets its gradient through p (TopK itself is piecewise constant).
3. Active-state projection: X_act = X[idx] [T, k, C]; logits = (alpha_g * vec(X_act) phi_act) / rms(vec(X_act))
   + b_act, phi_act [k*C, k*K + k*k] = [post (k*K, row-major [slot, component]) | res (k*k, row-major [i, j])].
   H_post = 2 sigmoid [T, k, K]; H_res = Sinkhorn [T, k, k] (cfg.sinkhorn_iters/form/eps).
   alpha [4] = (pre, post, res, router), init cfg.alpha_init; biases zero (H_pre ~ 0.5, H_post ~ 1).
4. Temporal augmentation (MLP sub-layers with cfg.augmented): for each w in aug_kernels a causal depthwise
   convolution of y = F(u) along each sequence (`causal_depthwise`: position s sees positions s-w+1..s of its
   own sequence, zero before the start), weight [C, w] initialised N(0, (0.02 / sqrt(w))^2): each convolution
   output starts at about 0.02 rms(y), so at init the write-back is mHC-like (q_0 = y dominates).
   [y, conv_1(y), ..., conv_r(y)] -> modified Gram-Schmidt per token over C, not normalised (`gram_schmidt`)
   -> out_aug [T, K, C], q_0 = y. Otherwise K = 1 and out_aug = y[:, None].
5. Write-back (`write_back`): X_act' = H_res X_act + p * (H_post @ out_aug); X' = X with X' [idx] = X_act'.
   Inactive streams are copied bit for bit (scatter into X, no arithmetic on them).
6. xHC-Flash (cfg.flash): the MLP sub-layer takes idx and p from its block's attention coefficients
   (`coefficients(x, routing=c_attn)`); its router columns are not evaluated. H_pre, H_post, H_res are its own.

Reduction to mHC (tested in float64): with N = k = fixed and augment='none', idx = (0, ..., N-1) and p = 1 for
every token, X_act = X and both rms are over the same N*C vector, so
  XHCSublayer(phi_full, phi_act, alpha, b_full, b_act) == MHCSublayer('mhc', n=N) with
  phi = [phi_full[:, N:] | phi_act[:, :N] | phi_act[:, N:]], alpha = alpha[:3], bias = [b_full[N:] | b_act];
the router parameters (phi_full[:, :N], b_full[:N], alpha[3]) are unused.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import MHCConfig
from .reference import acc_dtype, pre
from .sinkhorn import sinkhorn
from .sinkhorn_node import sinkhorn_node

__all__ = ["XHCCoefficients", "XHCView", "XHCSublayer", "route", "causal_depthwise", "gram_schmidt", "write_back"]


class XHCCoefficients(NamedTuple):
    """h_pre [T, N], idx [T, k] long, gate [T, k], h_post [T, k, K], h_res [T, k, k] (to slot i, from slot j)."""

    h_pre: torch.Tensor
    idx: torch.Tensor
    gate: torch.Tensor
    h_post: torch.Tensor
    h_res: torch.Tensor


class XHCView(NamedTuple):
    """N-stream view for diagnostics: read [T, N], write [T, N], res [T, N, N] (identity on inactive streams)."""

    read: torch.Tensor
    write: torch.Tensor
    res: torch.Tensor


def route(scores: torch.Tensor, k: int, fixed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Active set from router scores [T, N] -> (idx [T, k] long, gate [T, k]); fixed slots first, then TopK."""
    if scores.dim() != 2:
        raise ValueError(f"scores must be [T, N], got shape {tuple(scores.shape)}")
    t, n = scores.shape
    if not 0 <= fixed <= k <= n:
        raise ValueError(f"route needs 0 <= fixed <= k <= N, got fixed={fixed}, k={k}, N={n}")
    head = torch.arange(fixed, device=scores.device).expand(t, fixed)
    # Ascending stream order of the routed slots makes the slot layout independent of TopK's output order.
    top = torch.topk(scores[:, fixed:], k - fixed, dim=1).indices.sort(dim=1).values + fixed
    gate = torch.cat([torch.ones(t, fixed, dtype=scores.dtype, device=scores.device), scores.gather(1, top)], 1)
    return torch.cat([head, top], 1), gate


def causal_depthwise(y: torch.Tensor, weight: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Per-channel causal convolution within each sequence: out[s] = sum_i weight[:, i] y[s - w + 1 + i].

    y [T, C] (T = B * seq_len), weight [C, w] -> [T, C] in the accumulation dtype. A fixed-order sum of shifted
    products (no conv kernel), so it is deterministic on every device.
    """
    if y.dim() != 2:
        raise ValueError(f"y must be [T, C], got shape {tuple(y.shape)}")
    t, c = y.shape
    if weight.dim() != 2 or weight.shape[0] != c:
        raise ValueError(f"weight must be [C, w] = [{c}, w], got {tuple(weight.shape)}")
    if seq_len < 1 or t % seq_len:
        raise ValueError(f"T={t} tokens is not a multiple of seq_len={seq_len}: the convolution runs within "
                         "sequences of seq_len contiguous tokens; pass T = B * seq_len")
    dt = acc_dtype(y)
    w = weight.shape[1]
    # Zero left padding per sequence: position s never sees s+1.. nor the previous sequence.
    yp = F.pad(y.to(dt).view(t // seq_len, seq_len, c), (0, 0, w - 1, 0))
    wt = weight.to(dt)
    out = yp[:, 0:seq_len] * wt[:, 0]
    for i in range(1, w):
        out = out + yp[:, i : i + seq_len] * wt[:, i]
    return out.reshape(t, c)


def gram_schmidt(components: torch.Tensor) -> torch.Tensor:
    """Modified Gram-Schmidt per token over C, not normalised: [T, K, C] -> [T, K, C], q_0 = components[:, 0].

    q_i starts as c_i and loses its projection on q_0, ..., q_{i-1} one at a time (on the updated q_i), each
    divided by <q_j, q_j> + delta. delta = machine eps of the accumulation dtype times the token's mean
    component energy (+ the smallest normal, for all-zero tokens): near the start of a sequence the
    convolutions see only span(y_<=s), so some q_j vanish, and a relative delta stops their roundoff from
    being projected out (and their gradients from exploding) while costing ~eps relative orthogonality.
    """
    if components.dim() != 3:
        raise ValueError(f"components must be [T, K, C], got shape {tuple(components.shape)}")
    dt = acc_dtype(components)
    c = components.to(dt)
    fi = torch.finfo(dt)
    delta = fi.eps * (c * c).sum(-1).mean(-1, keepdim=True) + fi.tiny  # [T, 1]
    qs: list[torch.Tensor] = []
    dens: list[torch.Tensor] = []
    for i in range(c.shape[1]):
        q = c[:, i]
        for qj, dj in zip(qs, dens):
            q = q - ((q * qj).sum(-1, keepdim=True) / dj) * qj
        qs.append(q)
        dens.append((q * q).sum(-1, keepdim=True) + delta)
    return torch.stack(qs, 1)


def _check_coeffs(co: XHCCoefficients, t: int, n: int, k: int, big_k: int | None = None) -> None:
    kk = co.h_post.shape[-1] if big_k is None else big_k
    want = {"h_pre": (t, n), "idx": (t, k), "gate": (t, k), "h_post": (t, k, kk), "h_res": (t, k, k)}
    for name, shape in want.items():
        if tuple(getattr(co, name).shape) != shape:
            raise ValueError(f"coeffs.{name} must be {list(shape)} (T, N, k, K), got {tuple(getattr(co, name).shape)}")
    if co.idx.dtype != torch.long:
        raise ValueError(f"coeffs.idx must be torch.long stream indices, got {co.idx.dtype}")


def write_back(x: torch.Tensor, out_aug: torch.Tensor, coeffs: XHCCoefficients) -> torch.Tensor:
    """X_act' = H_res X_act + gate * (H_post @ out_aug) scattered into X at idx -> [T, N, C] in x's dtype."""
    if x.dim() != 3:
        raise ValueError(f"x must be [T, N, C], got shape {tuple(x.shape)}")
    t, n, c = x.shape
    k = coeffs.idx.shape[-1]
    if out_aug.dim() != 3 or out_aug.shape[0] != t or out_aug.shape[2] != c:
        raise ValueError(f"out_aug must be [T, K, C] = [{t}, K, {c}], got {tuple(out_aug.shape)}")
    _check_coeffs(coeffs, t, n, k, out_aug.shape[1])
    dt = acc_dtype(x)
    index = coeffs.idx[:, :, None].expand(t, k, c)
    x_act = x.gather(1, index).to(dt)
    new = coeffs.h_res.to(dt) @ x_act + coeffs.gate.to(dt)[:, :, None] * (coeffs.h_post.to(dt) @ out_aug.to(dt))
    return x.scatter(1, index, new.to(x.dtype))


class XHCSublayer(nn.Module):
    """One sub-layer F wrapped in xHC; mirrors MHCSublayer (coefficients / apply_pre / apply_post_res / forward).

    `mlp` marks MLP sub-layers: they get the temporal augmentation (cfg.augmented) and, with cfg.flash, reuse
    the routing of their block's attention sub-layer. `layer_index` is kept for interface parity (xHC's init
    does not depend on depth).
    """

    def __init__(self, config: MHCConfig, sublayer: nn.Module, hidden: int, layer_index: int = 0, *,
                 seq_len: int, mlp: bool):
        super().__init__()
        if config.variant != "xhc":
            raise ValueError(f"config.variant={config.variant!r}: XHCSublayer needs variant='xhc' (use MHCSublayer)")
        if hidden < 1:
            raise ValueError(f"hidden={hidden} must be >= 1 (the stream width C)")
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1 (tokens per sequence; T = B * seq_len)")
        self.config, self.sublayer, self.hidden = config, sublayer, hidden
        self.layer_index, self.seq_len, self.mlp = layer_index, seq_len, mlp
        self.augmented = mlp and config.augmented
        n, k, c = config.n, config.k, hidden
        self.num_components = len(config.aug_kernels) + 1 if self.augmented else 1
        kk = self.num_components
        # Parameters stay fp32 whatever dtype the streams use (mhc.md §2.2).
        self.phi_full = nn.Parameter(torch.randn(n * c, 2 * n) / (n * c) ** 0.5)
        self.phi_act = nn.Parameter(torch.randn(k * c, k * kk + k * k) / (k * c) ** 0.5)
        self.alpha = nn.Parameter(torch.full((4,), float(config.alpha_init)))
        self.bias_full = nn.Parameter(torch.zeros(2 * n))
        self.bias_act = nn.Parameter(torch.zeros(k * kk + k * k))
        self.conv = nn.ParameterList(
            [nn.Parameter(torch.randn(c, w) * (0.02 / w**0.5)) for w in config.aug_kernels] if self.augmented else []
        )

    def _check(self, x: torch.Tensor) -> None:
        n, c = self.config.n, self.hidden
        if x.dim() != 3 or x.shape[1] != n or x.shape[2] != c:
            raise ValueError(f"x must be [T, N, C] = [T, {n}, {c}] (config.n, hidden), got {tuple(x.shape)}")

    def _check_seq(self, t: int) -> None:
        if self.augmented and t % self.seq_len:
            raise ValueError(f"T={t} tokens is not a multiple of seq_len={self.seq_len}: the MLP augmentation "
                             "convolves within sequences of seq_len contiguous tokens; pass T = B * seq_len")

    def coefficients(self, x: torch.Tensor, routing: XHCCoefficients | None = None) -> XHCCoefficients:
        """H_pre (all N streams), the active set and gate (routed, or taken from `routing`), H_post and H_res."""
        self._check(x)
        cfg = self.config
        t, n, c = x.shape
        k, kk = cfg.k, self.num_components
        flash_mlp = cfg.flash and self.mlp
        if flash_mlp and routing is None:
            raise ValueError("routing=None on an xHC-Flash MLP sub-layer: pass its block's attention coefficients "
                             "(coefficients(x, routing=c_attn))")
        if routing is not None and not flash_mlp:
            raise ValueError("routing is only taken by MLP sub-layers with config.flash=True; pass routing=None")
        dt = acc_dtype(x)
        alpha, b = self.alpha.to(dt), self.bias_full.to(dt)
        v = x.reshape(t, n * c).to(dt)
        need_router = routing is None and k > cfg.fixed
        # One read of X for router + pre logits; without routing the router columns are not evaluated.
        mix = v @ (self.phi_full if need_router else self.phi_full[:, n:]).to(dt)
        rinv = torch.rsqrt((v * v).sum(-1, keepdim=True) / (n * c) + cfg.rms_eps)
        pre_eps = cfg.eps if cfg.sinkhorn_form == "softmax" else 0.0
        h_pre = torch.sigmoid(rinv * alpha[0] * mix[:, -n:] + b[n:]) + pre_eps
        if routing is not None:
            _check_coeffs(routing, t, n, k)
            idx, gate = routing.idx, routing.gate
        elif need_router:
            idx, gate = route(torch.sigmoid(rinv * alpha[3] * mix[:, :n] + b[:n]), k, cfg.fixed)
        else:  # k == fixed: no routed slots, the router is not needed
            idx, gate = route(torch.zeros(t, n, dtype=dt, device=x.device), k, cfg.fixed)
        va = x.gather(1, idx[:, :, None].expand(t, k, c)).reshape(t, k * c).to(dt)
        mix_a = va @ self.phi_act.to(dt)
        rinv_a = torch.rsqrt((va * va).sum(-1, keepdim=True) / (k * c) + cfg.rms_eps)
        ba = self.bias_act.to(dt)
        h_post = 2.0 * torch.sigmoid(rinv_a * alpha[1] * mix_a[:, : k * kk] + ba[: k * kk])
        m_res = rinv_a * alpha[2] * mix_a[:, k * kk :] + ba[k * kk :]
        project_res = sinkhorn if cfg.backend == "reference" else sinkhorn_node  # same values (kernels.eager)
        h_res = project_res(m_res.view(t, k, k), cfg.sinkhorn_iters, cfg.sinkhorn_form, cfg.eps)
        return XHCCoefficients(h_pre, idx, gate, h_post.view(t, k, kk), h_res)

    def apply_pre(self, x: torch.Tensor, coeffs: XHCCoefficients) -> torch.Tensor:
        """The sub-layer input sum_j H_pre[j] X[j] over all N streams -> [T, C]."""
        self._check(x)
        return pre(x, coeffs.h_pre)

    def augment(self, y: torch.Tensor) -> torch.Tensor:
        """F's output y [T, C] -> out_aug [T, K, C] (accumulation dtype): y and its orthogonalised convolutions."""
        if not self.augmented:
            return y.to(acc_dtype(y))[:, None]
        comps = [y.to(acc_dtype(y))] + [causal_depthwise(y, w, self.seq_len) for w in self.conv]
        return gram_schmidt(torch.stack(comps, 1))

    def apply_post_res(self, x: torch.Tensor, y: torch.Tensor, coeffs: XHCCoefficients) -> torch.Tensor:
        """Write-back of F's output y [T, C] into the active streams -> [T, N, C]; deterministic (recompute)."""
        self._check(x)
        t, _, c = x.shape
        if y.shape != (t, c):
            raise ValueError(f"y (the sub-layer output) must be [T, C] = [{t}, {c}], got {tuple(y.shape)}")
        self._check_seq(t)
        _check_coeffs(coeffs, t, self.config.n, self.config.k, self.num_components)
        return write_back(x, self.augment(y), coeffs)

    def forward(self, x: torch.Tensor, routing: XHCCoefficients | None = None) -> torch.Tensor:
        self._check(x)
        self._check_seq(x.shape[0])  # before F runs
        coeffs = self.coefficients(x, routing)
        return self.apply_post_res(x, self.sublayer(self.apply_pre(x, coeffs)), coeffs)

    def diagnostic_view(self, coeffs: XHCCoefficients) -> XHCView:
        """read = H_pre; write[s] = p * sum_K H_post on active stream s (0 elsewhere); res = H_res embedded at
        idx, identity on inactive streams. With K = 1: X' = res X + write * y exactly."""
        t, k = coeffs.idx.shape
        n = self.config.n
        _check_coeffs(coeffs, t, n, k)
        h_res = coeffs.h_res
        write = torch.zeros(t, n, dtype=h_res.dtype, device=h_res.device)
        write = write.scatter(1, coeffs.idx, coeffs.gate.to(h_res.dtype) * coeffs.h_post.sum(-1))
        inactive = torch.ones(t, n, dtype=h_res.dtype, device=h_res.device).scatter(1, coeffs.idx, 0.0)
        rows = torch.arange(t, device=h_res.device)[:, None, None]
        res = torch.diag_embed(inactive).index_put((rows, coeffs.idx[:, :, None], coeffs.idx[:, None, :]), h_res)
        return XHCView(coeffs.h_pre, write, res)

    def extra_repr(self) -> str:
        cfg = self.config
        return (f"N={cfg.n}, k={cfg.k}, fixed={cfg.fixed}, K={self.num_components}, hidden={self.hidden}, "
                f"seq_len={self.seq_len}, mlp={self.mlp}, flash={cfg.flash}")
