"""Single-pass mHC (variant 'mhc-sp', DeepSeek-V4.1 report §2.4.1; mhc.md §3): the input mixing of a sub-layer
uses the coefficient predicted one sub-layer earlier, so the state carried between sub-layers grows by n values.

Shape letters: T tokens, n streams, C hidden (= `hidden`), e extra elements per stream in a packed boundary
tensor, d bytes per activation element. V4 names: A = H_pre (input mixing), B = H_res, C = H_post.

Recurrence (sub-layer l, X_l [T, n, C]):

    X_{l+1} = B_l X_l + C_l^T F_l(A_{l-1} X_l)
    (A_l, B_l, C_l) = one projection of X_l with exactly mHC's parameters and formulas (reference.project +
                      reference.coefficients; 'mhc-sp' behaves as 'mhc': A = sigmoid, C = 2 sigmoid, B = Sinkhorn)

A_l is not used by sub-layer l: it is carried to sub-layer l+1 and mixes that sub-layer's input. The state
between sub-layers is therefore (X_l in the activation dtype, a = A_{l-1} [T, n] in fp32, fp64 for fp64
activations). `single_pass` is the pass one fused kernel would do after F_l: with one read of X_l and y_l =
F_l(u_l) it writes X_{l+1} and the next sub-layer's input u_{l+1} = A_l X_{l+1} (from the stored X_{l+1}, the
tensor the next sub-layer reads; the reference here is plain PyTorch, and the module's step equals it).

Ends of the stack. The first sub-layer has no predecessor: it mixes with a static learned entry coefficient
A_{-1} = sigmoid(entry_logits), entry_logits a parameter [n] initialised 0 (so A_{-1} = 1/2, as mHC's H_pre at
init). That is our assumption: the V4.1 sources do not describe the first sub-layer. The end of the pipeline
contracts with the last carried coefficient, `contract(x, a) = sum_j a[j] x[j]` -> [T, C] (V4.1 folds the streams
with it before the head; not the stream mean of kernels.module.contract).

Stage boundary. X and a travel as one tensor per P2P message: `pack_state` puts a's bits next to each stream's
C channels, [T, n, C + e] in the activation dtype (e = 1 for fp32 and fp64 activations, e = 2 for bf16: the
fp32 value viewed as two bf16), and `unpack_state` reads them back bit-exactly. Per micro-batch the forward
message is T n C d + 4 n T bytes (8 n T for fp64 activations), and the backward message the same: the gradient
of a (fp32, bit-exact in the same slots) goes back with dX. `carry_bytes` is the 4 n per token
(costmodel.physics.mhc_cost.ResidualSpec('mhc-sp', n).carry_bytes).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from . import reference
from .config import MHCConfig
from .module import Coefficients, MHCSublayer

__all__ = ["SinglePassSublayer", "SPView", "single_pass", "entry_coefficient", "contract", "boundary_width",
           "pack_state", "unpack_state", "carry_bytes", "carry_dtype"]

_ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def carry_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the carried coefficient a for activations of `dtype`: fp32, fp64 for fp64 activations."""
    if dtype not in _ACT_DTYPES:
        raise ValueError(f"activation dtype {dtype} is not supported by mhc-sp; use fp32, bf16 or fp64")
    return torch.float64 if dtype == torch.float64 else torch.float32


def carry_bytes(n: int, dtype: torch.dtype) -> int:
    """Bytes per token of a on the wire (each direction): 4n for fp32/bf16 activations, 8n for fp64."""
    if n < 1:
        raise ValueError(f"n={n} must be >= 1 (the number of streams)")
    return n * carry_dtype(dtype).itemsize


def boundary_width(hidden: int, dtype: torch.dtype) -> int:
    """Last dim of a packed boundary tensor: C + e, e = a's itemsize / the activation itemsize."""
    if hidden < 1:
        raise ValueError(f"hidden={hidden} must be >= 1 (the stream width C)")
    return hidden + carry_dtype(dtype).itemsize // dtype.itemsize


def entry_coefficient(logits: torch.Tensor, t: int, dtype: torch.dtype) -> torch.Tensor:
    """A_{-1} = sigmoid(logits [n]) for every token -> [T, n] in carry_dtype(dtype), dtype = the activations'."""
    if logits.dim() != 1:
        raise ValueError(f"entry logits must be [n], got shape {tuple(logits.shape)}")
    if t < 0:
        raise ValueError(f"t={t} must be >= 0 (the number of tokens)")
    return torch.sigmoid(logits.to(carry_dtype(dtype))).expand(t, logits.shape[0]).contiguous()


def _check_a(a: torch.Tensor, x: torch.Tensor, name: str = "a") -> None:
    if a.shape != x.shape[:2]:
        raise ValueError(f"{name} (the carried coefficient) must be [T, n] = {tuple(x.shape[:2])}, got "
                         f"{tuple(a.shape)}")


def contract(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Pipeline exit: sum_j a[j] x[j] with the last carried coefficient, x [T, n, C], a [T, n] -> [T, C]."""
    reference._check_x(x)
    _check_a(a, x)
    return reference.pre(x, a)


def single_pass(x: torch.Tensor, y: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor,
                a_next: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused-form pass after F_l: X_{l+1} = B_l X_l + C_l^T y and u_{l+1} = A_l X_{l+1}.

    x [T, n, C], y = F_l's output [T, C], h_post = C_l [T, n], h_res = B_l [T, n, n], a_next = A_l [T, n]
    -> (X_{l+1} [T, n, C], u_{l+1} [T, C]). Reference PyTorch (two ops where a kernel does one read)."""
    x_next = reference.post_res(x, y, h_post, h_res)
    _check_a(a_next, x, "a_next")
    return x_next, reference.pre(x_next, a_next)


# ---------------------------------------------------------------- carried-state packing (one P2P tensor)
def _a_as_act(a: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
    """a [T, n] -> its bits as [T, n, e] elements of act_dtype (no arithmetic: bit-exact)."""
    return a.contiguous().unsqueeze(-1).view(act_dtype)


def _a_from_act(tail: torch.Tensor, a_dtype: torch.dtype) -> torch.Tensor:
    """[T, n, e] elements of the activation dtype -> the a [T, n] whose bits they hold."""
    return tail.contiguous().view(a_dtype).squeeze(-1)


def _pack(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, _a_as_act(a, x.dtype)], dim=-1)


class _Pack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, a):
        ctx.c, ctx.a_dtype = x.shape[-1], a.dtype
        return _pack(x, a)

    @staticmethod
    def backward(ctx, g):
        # The gradient of the packed tensor is the packed gradients: unpack it, no arithmetic.
        return g[..., : ctx.c], _a_from_act(g[..., ctx.c :], ctx.a_dtype)


class _Unpack(torch.autograd.Function):
    # One node for both outputs: with x as a separate slice node, autograd would sum the two zero-padded
    # gradients into the packed one, and x + 0 changes bf16 bit patterns (-0 -> +0, NaN quieting) of da.
    @staticmethod
    def forward(ctx, packed, c, a_dtype):
        ctx.c = c
        return packed[..., :c], _a_from_act(packed[..., c:], a_dtype)

    @staticmethod
    def backward(ctx, dx, da):
        return _pack(dx, da), None, None


def pack_state(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """(X [T, n, C], a [T, n] in carry_dtype(X.dtype)) -> one tensor [T, n, C + e] in X's dtype, differentiable."""
    reference._check_x(x)
    _check_a(a, x)
    if a.dtype != carry_dtype(x.dtype):
        raise ValueError(f"a has dtype {a.dtype}; for {x.dtype} activations it must be {carry_dtype(x.dtype)} "
                         "(the coefficients' dtype), cast it before packing")
    return _Pack.apply(x, a)


def unpack_state(packed: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, n, C + e] -> (X [T, n, C], a [T, n]), bit-exact. X is a view of `packed` (do not modify it in place)."""
    width = boundary_width(hidden, packed.dtype)
    if packed.dim() != 3 or packed.shape[-1] != width:
        raise ValueError(f"packed must be [T, n, C + e] = [T, n, {width}] (hidden={hidden}, {packed.dtype}), "
                         f"got {tuple(packed.shape)}")
    return _Unpack.apply(packed, hidden, carry_dtype(packed.dtype))


# ---------------------------------------------------------------- the module
class SPView(NamedTuple):
    """What sub-layer l does to the streams: read = A_{l-1} [T, n], write = C_l [T, n], res = B_l [T, n, n]."""

    read: torch.Tensor
    write: torch.Tensor
    res: torch.Tensor


class SinglePassSublayer(MHCSublayer):
    """X_{l+1} = B_l X_l + C_l^T F_l(A_{l-1} X_l); forward(x, a_prev) -> (X_{l+1}, A_l).

    mHC's parameters, init, `coefficients` (h_pre = A_l for the NEXT sub-layer, h_post = C_l, h_res = B_l) and
    `apply_post_res` (MHCSublayer's); only the read differs: it takes the carried coefficient A_{l-1}."""

    def __init__(self, config: MHCConfig, sublayer: nn.Module, hidden: int, layer_index: int = 0):
        if config.variant != "mhc-sp":
            raise ValueError(f"config.variant={config.variant!r}: SinglePassSublayer implements 'mhc-sp'; use "
                             "kernels.module.MHCSublayer for the other variants")
        super().__init__(config, sublayer, hidden, layer_index)

    def apply_pre(self, x: torch.Tensor, a_prev: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Sub-layer input u_l = A_{l-1} X_l -> [T, C] (the carried coefficient, not this layer's h_pre)."""
        self._check(x)
        _check_a(a_prev, x, "a_prev")
        return self._ops(x).pre(x, a_prev)

    def forward(  # type: ignore[override]
            self, x: torch.Tensor, a_prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        coeffs = self.coefficients(x)
        y = self.sublayer(self.apply_pre(x, a_prev))
        return self.apply_post_res(x, y, coeffs), coeffs.h_pre

    @staticmethod
    def diagnostic_view(coeffs: Coefficients, a_prev: torch.Tensor) -> SPView:
        """The read/write/residual coefficients sub-layer l actually applies (read is the carried A_{l-1})."""
        if a_prev.shape != coeffs.h_post.shape:
            raise ValueError(f"a_prev must be [T, n] = {tuple(coeffs.h_post.shape)}, got {tuple(a_prev.shape)}")
        return SPView(read=a_prev, write=coeffs.h_post, res=coeffs.h_res)
