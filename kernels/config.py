"""The one config object that pins every mHC convention (mhc.md §2, §9 pitfall 3).

Shape letters: T tokens, n residual streams, C hidden size of one stream.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kernels import residual_spec as rs

Variant = Literal[rs.NAMES]  # the variants (kernels.residual_spec: the one list)
SinkhornForm = Literal["exp", "softmax"]
ExpandMode = Literal["copy", "lss"]
Backend = Literal["auto", "reference", "fused"]

VARIANTS: tuple[str, ...] = rs.NAMES
FUSED_VARIANTS = tuple(n for n, v in rs.VARIANTS.items() if v.fused_kernels)  # built from kernels.fused's ops
MHC_LITE_MAX_N = rs.VARIANTS["mhc-lite"].max_n  # 4! = 24 logits; 5! = 120 is already past the point of the trick


class MHCConfig(BaseModel):
    """Hyper-connection settings for one stack. Every sub-layer of the stack shares them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    variant: Variant = Field(
        "mhc",
        description="'residual' (n=1, exactly x + F(x)), 'hc' (unconstrained tanh form, mHC Eq. 5), "
        "'mhc' (Sinkhorn-projected H_res), 'mhc-lite' (convex mix of the n! permutation matrices, n <= 4), "
        "'mhc-sp' (single-pass mHC, DeepSeek-V4.1: a sub-layer reads its input with the coefficient the previous "
        "sub-layer predicted; kernels.single_pass), 'xhc' (n = N streams of which `active` are mixed per token: "
        "kernels.xhc).",
    )
    n: int = Field(4, ge=1, description="Number of residual streams (expansion rate). Must be 1 for 'residual'.")
    sinkhorn_iters: int = Field(20, ge=1, description="t_max: Sinkhorn rounds, each one T_c then T_r (mHC, V4: 20).")
    sinkhorn_form: SinkhornForm = Field(
        "exp",
        description="'exp': paper Eq. 9 (exp, then alternate T_c, T_r, no eps). 'softmax': production form "
        "(column softmax + eps, every later step divides by sum + eps, H_pre = sigmoid + eps).",
    )
    eps: float = Field(1e-6, ge=0.0, description="Sinkhorn/H_pre eps of the 'softmax' form (TK, MLM, V4: 1e-6).")
    rms_eps: float = Field(
        1e-6,
        ge=0.0,
        description="eps inside the sqrt of the flattened-nC RMSNorm (production choice; Eq. 15 has none). "
        "Keeps all-zero tokens (padding) finite.",
    )
    alpha_init: float = Field(0.01, description="Initial value of the three gates alpha_pre/post/res (mHC App. A.1).")
    expand: ExpandMode = Field(
        "copy", description="Stack entry: 'copy' (x_0[i] = h) or 'lss' (x_0[i] = h * s_i, learned s, arXiv 2606.03483)."
    )
    active: int | None = Field(
        None, ge=1,
        description="xhc only: k, the streams active per token and sub-layer (fixed + routed); default min(4, n). "
        "H_res (k x k, Sinkhorn) and the write-back cover the active streams only; the read H_pre covers all n.",
    )
    fixed: int = Field(2, ge=0, description="xhc only: how many active streams are fixed (streams 0..fixed-1); the "
                       "other active - fixed are chosen per token by the router's TopK.")
    augment: str = Field(
        "mlp",
        description="xhc only: temporal augmentation of the write-back, 'mlp' (MLP sub-layers: the output plus its "
        "causal depthwise convolutions, orthogonalised by modified Gram-Schmidt) or 'none'.",
    )
    aug_kernels: tuple[int, ...] = Field(
        (4, 8, 12), description="xhc only: kernel sizes of the causal depthwise convolutions (r of them: K_r = r + 1 "
        "write-back components); () is the same as augment='none'.")
    flash: bool = Field(False, description="xhc only: xHC-Flash, the MLP sub-layer reuses its block's attention "
                        "routing (active streams and gates) instead of routing the full state again.")
    backend: Backend = Field(
        "auto",
        description="'auto': fused Triton on CUDA (or on CPU under TRITON_INTERPRET=1 when imported that way), "
        "otherwise the eager ops (kernels.eager: the reference's math with Sinkhorn as one autograd node). 'fused' "
        "raises if Triton cannot run; 'reference' always uses the unrolled pure-PyTorch definition of truth.",
    )

    @model_validator(mode="after")
    def _check(self) -> "MHCConfig":
        spec = rs.variant(self.variant)
        if not spec.takes_k:
            rs.check_shape(self.variant, self.n, None)  # one stream for 'residual', n <= 4 for 'mhc-lite'
        if spec.takes_k:
            k = self.k
            if k > self.n:
                raise ValueError(f"active={k} > n={self.n} with variant='xhc': at most n streams can be active; "
                                 f"e.g. n=16, active=4")
            if self.fixed > k:
                raise ValueError(f"fixed={self.fixed} > active={k} with variant='xhc': the fixed streams are part of "
                                 "the active ones; lower fixed")
            if self.augment not in ("mlp", "none"):
                raise ValueError(f"augment={self.augment!r} with variant='xhc': temporal augmentation applies to the "
                                 "MLP write-back only (causal convolutions + Gram-Schmidt of the MLP output); use "
                                 "'mlp' or 'none'")
            if any(w < 1 for w in self.aug_kernels):
                raise ValueError(f"aug_kernels={self.aug_kernels}: every kernel size must be >= 1, e.g. (4, 8, 12)")
        else:
            for name, value, default in (("active", self.active, None), ("flash", self.flash, False)):
                if value != default:
                    raise ValueError(f"{name}={value!r} applies to variant='xhc' only; drop it for "
                                     f"variant={self.variant!r}")
        if self.backend == "fused" and self.variant == "xhc":
            raise ValueError(f"backend='fused' with variant='xhc' (n={self.n}): no fused kernel implements xHC's "
                             f"n-stream dense read and k-stream write-back (the Triton kernels serve "
                             f"{', '.join(FUSED_VARIANTS)}); use backend='auto' or 'reference'")
        return self

    @property
    def k(self) -> int:
        """Active streams per token: `active` for xhc (default min(4, n)), n for every other variant."""
        if self.variant != "xhc":
            return self.n
        return self.active if self.active is not None else min(4, self.n)

    @property
    def label(self) -> str:
        """The name a run's flags and folders use for this residual ('mhc:4', 'xhc:16:4'; `--residual`)."""
        return rs.label(self.variant, self.n, self.k)

    @property
    def augmented(self) -> bool:
        """xhc with temporal augmentation on its MLP sub-layers."""
        return self.variant == "xhc" and self.augment == "mlp" and len(self.aug_kernels) > 0

    @property
    def num_res_logits(self) -> int:
        """Width of the res block of the mix vector: n^2 (hc, mhc) or n! (mhc-lite)."""
        return rs.num_res_logits(self.variant, self.n) if rs.variant(self.variant).res_logits == "n!" \
            else self.n * self.n

    @property
    def num_mix(self) -> int:
        """Projection width [pre (n) | post (n) | res]; for 'hc' it is per stream: 1 + 1 + n."""
        if self.variant == "hc":
            return self.n + 2
        return 2 * self.n + self.num_res_logits


def check_variant(variant: str) -> str:
    """Raise a ValueError naming the field for an unknown variant string passed outside the config."""
    rs.variant(variant)  # ValueError naming the choices
    return variant
