"""The residual side of a sub-layer, priced by bytes: plain residual, HC, mHC (fused / unfused), mHC-lite, xHC.

Element counts per token and sub-layer (mhc.md §4; C = hidden, n = streams; coefficient traffic O(n^2) is added
explicitly in fp32):

| variant | forward read / write | backward read / write | recompute |
| --- | --- | --- | --- |
| residual | 2C / C (the add) | 2C / C (gradient accumulation) | - |
| mhc fused (TK kernels) | (3n+1)C / (n+1)C = 18C at n=4 | (6n+2)C / (3n+1)C = 39C | C + nC per block / (n+1)C |
| mhc unfused, hc (mHC Table 2) | (5n+1)C / (3n+1)C = 34C | 2x the forward (each op's backward reads its inputs and the output-grad and writes the input-grads; derived) | the post/res/merge part of the forward |
| mhc-lite | as mhc fused; no Sinkhorn; softmax over n! logits and a sum of n! permutation matrices | | |
| xhc (N streams, k active) | a N + b k + 2 (C units, total) | 2x the forward | as mhc fused with n = N |

xHC: two anchors fix the linear form: mHC's unfused 34C at N = k = n = 4 (8n + 2) and xHC's reported 73.5C at
N = 16, k = 4 (arXiv 2607.14530): a + b = 8 and 16a + 4b + 2 = 73.5, so a = 3.29 (dense reads over all N streams)
and b = 4.71 (sparse write-back over the k active ones) (derived). xHC-Flash (51C) is `fused=True`, which scales
the same kernels by 51/73.5. Mapping generation is O(k^3 C): 2 k C (k^2 + 2k) FLOPs per token, Sinkhorn on k x k.

Kernel boundaries follow the paper (§4.3.1): proj (Eq. 14-15, tf32, reads the nC state once), split, Sinkhorn,
F_pre, F_post,res; backward post_bwd, pre_apply_mix_bwd, sinkhorn_bwd, norm_fn_bwd; recompute one kernel per block
of L_r sub-layers. Every kernel is priced separately (memory curve + launch). FLOPs are negligible but counted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from costmodel.ops import Kernel, vec

VARIANTS = ("residual", "hc", "mhc", "mhc-lite", "xhc")
XHC_DENSE, XHC_SPARSE = 39.5 / 12, 8 - 39.5 / 12  # derived above
XHC_FLASH_RATIO = 51 / 73.5


@dataclass(frozen=True)
class ResidualSpec:
    """Which residual the cost model prices. n: streams (N for xHC); k: active streams (xHC only)."""

    variant: str = "mhc"
    n: int = 4
    k: int | None = None
    fused: bool = True
    sinkhorn_iters: int = 20

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown residual variant {self.variant!r}; choose one of {', '.join(VARIANTS)}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.variant == "residual" and self.n != 1:
            raise ValueError(f"variant 'residual' has one stream; got n={self.n} (use n=1 or another variant)")
        if self.variant == "mhc-lite" and self.n > 4:
            raise ValueError(f"mhc-lite enumerates n! permutations and supports n <= 4, got n={self.n}")
        if self.variant == "xhc":
            if self.k is None or not 1 <= self.k <= self.n:
                raise ValueError(f"xhc needs 1 <= k <= n active streams (got n={self.n}, k={self.k}); e.g. --n 16 --k 4")
        elif self.k is not None and self.k != self.n:
            raise ValueError(f"--k (active streams) applies to xhc only; variant {self.variant!r} uses all n streams")

    @property
    def is_baseline(self) -> bool:
        return self.variant == "residual" or self.n == 1 and self.variant != "xhc"

    @property
    def width(self) -> int:
        """Residual-state width in units of C: what crosses a stage boundary per token."""
        return 1 if self.is_baseline else self.n

    @property
    def num_mix(self) -> int:
        n = self.n
        if self.variant == "hc":
            return n * (n + 2)
        if self.variant == "mhc-lite":
            return 2 * n + math.factorial(n)
        if self.variant == "xhc":
            return 2 * self.k + self.k * self.k
        return 2 * n + n * n

    def label(self) -> str:
        if self.is_baseline:
            return "residual (n=1)"
        extra = f", k={self.k}" if self.variant == "xhc" else ""
        fused = "" if self.variant in ("hc",) else (" fused" if self.fused else " unfused")
        return f"{self.variant}{fused} (n={self.n}{extra})"

    @classmethod
    def baseline(cls) -> "ResidualSpec":
        return cls("residual", 1)


def _mem(name: str, elems_per_token: float, T: int, d: int, flops: float = 0.0, **kw) -> Kernel:
    return vec(name, elems_per_token * T * d, flops, group="mhc", **kw)


def residual_kernels(spec: ResidualSpec, T: int, C: int, d: int, mlp: bool, hp: bool) -> tuple[list[Kernel], list[Kernel], list[Kernel]]:
    """(before F, after F, backward) kernels of one sub-layer's residual side. `hp`: put the MLP-side post+res
    (and its backward, which feeds the combine/send) on the high-priority stream."""
    if spec.is_baseline:
        add = _mem("res.add", 3 * C, T, d, T * C)
        return [], [add], [replace(add, name="res.add.bwd")]
    n, t = spec.n, spec.sinkhorn_iters
    coef = 4 * spec.num_mix / d  # fp32 coefficients in units of d-byte elements
    post_stream = "hp" if (hp and mlp) else "compute"
    if spec.variant == "xhc":
        k = spec.k
        total = XHC_DENSE * n + XHC_SPARSE * k + 2
        scale = XHC_FLASH_RATIO if spec.fused else 1.0
        proj = _mem("xhc.proj", (n * C + coef) * scale, T, d, 2 * k * C * (k * k + 2 * k) * T)
        sink = vec("xhc.sinkhorn", 4 * 2 * k * k * T, 4 * t * k * k * T, group="mhc")
        pre = _mem("xhc.pre", ((XHC_DENSE - 1) * n * C + C) * scale, T, d, 2 * n * C * T)
        rest = (total - XHC_DENSE * n - 1) * C
        post = _mem("xhc.post_res", rest * scale, T, d, 4 * k * C * T, stream=post_stream)
        bwd = [replace(post, name="xhc.post_res.bwd", nbytes=2 * post.nbytes),
               replace(pre, name="xhc.pre.bwd", nbytes=2 * pre.nbytes),
               replace(sink, name="xhc.sinkhorn.bwd", flops=2 * sink.flops),
               replace(proj, name="xhc.proj.bwd", nbytes=2 * proj.nbytes, flops=2 * proj.flops)]
        return [proj, sink, pre], [post], bwd
    proj_flops = (2 * n * C * (n + 2) if spec.variant == "hc" else 2 * n * C * spec.num_mix) * T
    if spec.variant == "mhc":
        sink = vec("mhc.sinkhorn", 4 * 2 * n * n * T, 4 * t * n * n * T, group="mhc")
    elif spec.variant == "mhc-lite":
        nf = math.factorial(n)
        sink = vec("mhc.perm_mix", 4 * (nf + n * n) * T, (3 * nf + 2 * nf * n * n) * T, group="mhc")
    else:  # hc: tanh on the coefficients, folded into the split kernel
        sink = None
    split = vec("mhc.split", 4 * 2 * spec.num_mix * T, 4 * spec.num_mix * T, group="mhc")
    if sink is not None and not spec.fused and spec.variant == "mhc":
        # eager Sinkhorn: exp, then per round a column sum, a divide, a row sum and a divide (launch-bound,
        # mhc.md §8: vllm-omni #7545, ~127 launches per call)
        sink = replace(sink, launches=4 * t + 2)
    if spec.variant == "hc" or not spec.fused:
        # unfused, mHC Table 2: compute H (nC read), apply pre (nC in, C out), apply post (C in, nC out),
        # apply res (nC in, nC out), merge (2nC in, nC out); an unfused norm also writes the normed nC state
        proj = _mem("mhc.proj", n * C + coef, T, d, proj_flops)
        pre = _mem("mhc.pre", (n + 1) * C, T, d, 2 * n * C * T)
        post = _mem("mhc.post", (n + 1) * C, T, d, 2 * n * C * T, stream=post_stream)
        res = _mem("mhc.res", 2 * n * C, T, d, 2 * n * n * C * T, stream=post_stream)
        merge = _mem("mhc.merge", 3 * n * C, T, d, n * C * T, stream=post_stream)
        before = [proj, split] + ([sink] if sink else []) + [pre]
        after = [post, res, merge]
        bwd = [replace(kk, name=kk.name + ".bwd", nbytes=2 * kk.nbytes, flops=2 * kk.flops)
               for kk in reversed(before + after)]
        return before, after, bwd
    # fused (TK kernels)
    proj = _mem("mhc.proj", n * C + coef, T, d, proj_flops)
    pre = _mem("mhc.pre", (n + 1) * C, T, d, 2 * n * C * T)
    post = _mem("mhc.post_res", (2 * n + 1) * C, T, d, (2 * n * n + 2 * n) * C * T, stream=post_stream)
    bwd = [_mem("mhc.post_res.bwd", (3 * n + 2) * C + coef, T, d, 4 * n * n * C * T, stream=post_stream),
           _mem("mhc.pre.bwd", (3 * n + 1) * C, T, d, 4 * n * C * T),
           replace(sink, name=sink.name + ".bwd", flops=2 * sink.flops, nbytes=2 * sink.nbytes),
           _mem("mhc.proj.bwd", (3 * n) * C + coef, T, d, 2 * proj_flops / T * T)]
    return [proj, split, sink, pre], [post], bwd


def recompute_kernel(spec: ResidualSpec, T: int, C: int, d: int, sublayers: int) -> Kernel | None:
    """One recompute kernel for a block of `sublayers` sub-layers: reads C per sub-layer (F's output) plus the
    block input nC once, writes (n+1)C per sub-layer (x_l and H_pre x_l); the unfused forms redo their
    post/res/merge ops instead."""
    if spec.is_baseline or sublayers <= 0:
        return None
    n = spec.n
    if spec.variant == "hc" or (not spec.fused and spec.variant != "xhc"):
        per = (n + 1) * C + 2 * n * C + 3 * n * C + (n + 1) * C
    else:
        per = C + (n + 1) * C
    elems = per * sublayers + n * C
    return Kernel("mhc.recompute", "vector", 0.0, elems * T * d, launches=1, group="recompute")


def stack_ends(spec: ResidualSpec, T: int, C: int, d: int) -> tuple[list[Kernel], list[Kernel]]:
    """Expand at a pipeline's first stage (copy h into n streams) and contract at its last (mean over streams),
    forward kernels; their backwards cost the same bytes."""
    if spec.is_baseline:
        return [], []
    n = spec.n
    return ([_mem("mhc.expand", (n + 1) * C, T, d)], [_mem("mhc.contract", (n + 1) * C, T, d)])


def activation_elems(spec: ResidualSpec, C: int, d: int, recompute_block: int | None) -> float:
    """Extra activation elements per token and sub-layer the residual keeps for backward, on top of the
    sub-layer's own (mhc.md §5, Table 3). With recompute (block of L_r sub-layers): the block input nC / L_r and
    F's output C are kept, the coefficients too, and the sub-layer's own norm input and normed output (2C)
    are dropped because recompute rebuilds them; without: x_l (nC), F's output (C), coefficients, and for the
    unfused forms the normed nC state as well."""
    if spec.is_baseline:
        return 0.0
    n = spec.n
    coef = 4 * spec.num_mix / d
    if recompute_block:
        return n * C / recompute_block + C + coef - 2 * C
    unfused = spec.variant == "hc" or (not spec.fused and spec.variant != "xhc")
    return (2 * n + 1) * C + coef if unfused else (n + 1) * C + coef


def mhc_params_per_sublayer(spec: ResidualSpec, C: int) -> float:
    """phi (nC x mix, fp32), bias (mix) and three alphas."""
    if spec.is_baseline:
        return 0.0
    return spec.n * C * spec.num_mix + spec.num_mix + 3
