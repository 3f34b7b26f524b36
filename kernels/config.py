"""The one config object that pins every mHC convention (mhc.md §2, §9 pitfall 3).

Shape letters: T tokens, n residual streams, C hidden size of one stream.
"""
from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Variant = Literal["residual", "hc", "mhc", "mhc-lite"]
SinkhornForm = Literal["exp", "softmax"]
ExpandMode = Literal["copy", "lss"]
Backend = Literal["auto", "reference", "fused"]

VARIANTS: tuple[str, ...] = ("residual", "hc", "mhc", "mhc-lite")
MHC_LITE_MAX_N = 4  # n! permutation matrices: 4! = 24 logits, 5! = 120 is already past the point of the trick


class MHCConfig(BaseModel):
    """Hyper-connection settings for one stack. Every sub-layer of the stack shares them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    variant: Variant = Field(
        "mhc",
        description="'residual' (n=1, exactly x + F(x)), 'hc' (unconstrained tanh form, mHC Eq. 5), "
        "'mhc' (Sinkhorn-projected H_res), 'mhc-lite' (convex mix of the n! permutation matrices, n <= 4).",
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
    backend: Backend = Field(
        "auto",
        description="'auto': fused Triton on CUDA (or on CPU under TRITON_INTERPRET=1 when imported that way), "
        "reference otherwise. 'fused' raises if Triton cannot run; 'reference' always uses pure PyTorch.",
    )

    @model_validator(mode="after")
    def _check(self) -> "MHCConfig":
        if self.variant == "residual" and self.n != 1:
            raise ValueError(f"n={self.n} with variant='residual': the plain residual has one stream; set n=1")
        if self.variant == "mhc-lite" and self.n > MHC_LITE_MAX_N:
            raise ValueError(
                f"n={self.n} with variant='mhc-lite': it enumerates n! permutations and supports n <= "
                f"{MHC_LITE_MAX_N}; use variant='mhc' for larger n"
            )
        return self

    @property
    def num_res_logits(self) -> int:
        """Width of the res block of the mix vector: n^2 (hc, mhc) or n! (mhc-lite)."""
        return math.factorial(self.n) if self.variant == "mhc-lite" else self.n * self.n

    @property
    def num_mix(self) -> int:
        """Projection width [pre (n) | post (n) | res]; for 'hc' it is per stream: 1 + 1 + n."""
        if self.variant == "hc":
            return self.n + 2
        return 2 * self.n + self.num_res_logits


def check_variant(variant: str) -> str:
    """Raise a ValueError naming the field for an unknown variant string passed outside the config."""
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is unknown; choose one of {', '.join(VARIANTS)}")
    return variant
