"""What a residual variant is, in one place: the list of variants, each one's facts, the `VARIANT:N[:K]` spelling
(`--residual mhc:4`, `xhc:16:4`, a user model's `residual='mhc:4'`) and its parser, and the coefficient counts the
layers and the cost model both use (mhc.md §2).

Everything else dispatches on these facts instead of listing variant names: kernels.config (MHCConfig's checks),
costmodel.physics.mhc_cost (ResidualSpec), the run flags (pipeline.launch.run_args) and a user model's wrapper
(pipeline.user_model).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Variant:
    name: str
    summary: str
    one_stream: bool = False  # the plain residual: n must be 1
    max_n: int | None = None  # mhc-lite: n! permutation matrices, n <= 4
    takes_k: bool = False  # xhc: N streams, k of them active per token (VARIANT:N:K)
    fused_kernels: bool = False  # built from the ops kernels.fused implements (Triton)
    always_fused: bool = False  # mhc-sp: one fused pass per sub-layer by definition
    never_fused: bool = False  # hc: priced by mHC Table 2's separate ops
    carries_coefficient: bool = False  # mhc-sp: the next sub-layer's input coefficient crosses stage boundaries
    wraps_user_sublayers: bool = False  # a user model's [T, C] sub-layers can be wrapped in it (MHCSublayer)
    res_logits: str = "n^2"  # H_res logits: "n^2" (Sinkhorn or tanh), "n!" (mhc-lite), "k^2" (xhc: active streams)
    per_stream_mix: bool = False  # hc: pre (1) | post (1) | res (n) per stream
    layer: str = "sublayer"  # the module that runs it: kernels.module.MHCSublayer, "single_pass", "xhc"


VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("residual", "x + F(x), one stream", one_stream=True, wraps_user_sublayers=True),
    Variant("hc", "hyper-connections: unconstrained tanh form (mHC Eq. 5)", fused_kernels=True, never_fused=True,
            wraps_user_sublayers=True, per_stream_mix=True),
    Variant("mhc", "manifold-constrained: Sinkhorn-projected H_res", fused_kernels=True, wraps_user_sublayers=True),
    Variant("mhc-lite", "convex mix of the n! permutation matrices", max_n=4, fused_kernels=True,
            wraps_user_sublayers=True, res_logits="n!"),
    Variant("mhc-sp", "single-pass mHC (DeepSeek-V4.1): the coefficient predicted by the previous sub-layer",
            fused_kernels=True, always_fused=True, carries_coefficient=True, layer="single_pass"),
    Variant("xhc", "N streams, k active per token (xHC)", takes_k=True, res_logits="k^2", layer="xhc"),
)}
NAMES: tuple[str, ...] = tuple(VARIANTS)


def variant(name: str) -> Variant:
    """The variant named `name`; a ValueError naming the choices otherwise."""
    v = VARIANTS.get(name)
    if v is None:
        raise ValueError(f"variant={name!r} is unknown; choose one of {', '.join(NAMES)}")
    return v


def check_shape(name: str, n: int, k: int | None) -> None:
    """The rules every variant's (n, k) obeys, one ValueError naming the rule."""
    v = variant(name)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if v.one_stream and n != 1:
        raise ValueError(f"n={n} with variant={name!r}: the plain residual has one stream; set n=1")
    if v.max_n is not None and n > v.max_n:
        raise ValueError(f"n={n} with variant={name!r}: it enumerates n! permutations and supports n <= {v.max_n}; "
                         "use variant='mhc' for larger n")
    if v.takes_k:
        if k is not None and not 1 <= k <= n:
            raise ValueError(f"variant={name!r} needs 1 <= k <= n active streams (got n={n}, k={k}); e.g. xhc:16:4")
    elif k is not None and k != n:
        raise ValueError(f"k (active streams) applies to xhc only; variant {name!r} uses all n streams")


def label(name: str, n: int, k: int | None = None) -> str:
    """The spelling flags and folders use: 'mhc:4', 'xhc:16:4'."""
    return f"{name}:{n}" + (f":{k}" if variant(name).takes_k and k is not None else "")


def parse(text: str, check: bool = True) -> tuple[str, int, int | None]:
    """'mhc:4' -> ('mhc', 4, None); 'xhc:16:4' -> ('xhc', 16, 4). A ValueError saying how to write it otherwise.
    `check=False`: the spelling only (a caller that validates the values where a config names the field)."""
    name, *nums = str(text).split(":")
    if not nums or len(nums) > 2 or not all(x.isdigit() for x in nums):
        raise ValueError(f"{text!r}: use VARIANT:N, e.g. mhc:4, mhc-sp:4 or residual:1 (xHC: xhc:N:K, e.g. "
                         "xhc:16:4 = 16 streams, 4 active)")
    if len(nums) == 2 and name in VARIANTS and not VARIANTS[name].takes_k:
        raise ValueError(f"{text!r}: only xhc takes N:K (K active streams); use {name}:{nums[0]}")
    n, k = int(nums[0]), int(nums[1]) if len(nums) == 2 else None
    if check:
        check_shape(name, n, k)
    return name, n, k


def num_res_logits(name: str, n: int, k: int | None = None) -> int:
    """Width of the res block of one sub-layer's mix vector."""
    rule = variant(name).res_logits
    if rule == "n!":
        return math.factorial(n)
    if rule == "k^2":
        return (k if k is not None else n) ** 2
    return n * n


def num_mix(name: str, n: int, k: int | None = None) -> int:
    """Coefficients one sub-layer projects per token: [pre | post | res] over the streams it mixes (hc: per
    stream, 1 + 1 + n each, mHC Eq. 5)."""
    if variant(name).per_stream_mix:
        return n * (n + 2)
    width = k if variant(name).takes_k and k is not None else n
    return 2 * width + num_res_logits(name, n, k)
