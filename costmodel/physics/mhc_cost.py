"""The residual side of a sub-layer, priced by bytes: plain residual, HC, mHC (fused / unfused), mHC-lite,
single-pass mHC (DeepSeek-V4.1), xHC.

Shape letters: T tokens of a micro-batch, C hidden, n streams (N for xHC), k active streams (xHC), d bytes per
activation element, mix = 2n + n^2 coefficients per token and sub-layer (fp32: coef = 4 mix / d elements),
L sub-layers of a stage, r = L_r sub-layers of a recompute block.

Element counts per token and sub-layer (mhc.md §4; coefficient traffic O(n^2) is added explicitly in fp32; F's
own pre-norm, 2C, is priced with F in ops.py for every variant):

| variant | forward read / write | backward read / write | recompute (block of r) |
| --- | --- | --- | --- |
| residual | 2C / C (the add) | 2C / C (gradient accumulation) | x_l (l >= 1) from x_l0 and y: C + (r-1)C / (r-1)C |
| mhc fused (TK kernels) | (3n+1)C / (n+1)C = 18C at n=4 | (6n+2)C / (3n+1)C = 39C | nC + (r-1)C / (r-1)nC + rC |
| mhc unfused, hc (mHC Table 2) | (5n+1)C / (3n+1)C = 34C | 2x the forward (each op's backward reads its inputs and the
output-grad and writes the input-grads; derived) | the post/res/merge/pre ops again |
| mhc-lite | as mhc fused; no Sinkhorn; softmax over n! logits and a sum of n! permutation matrices | | |
| mhc-sp (single pass) | (n+1)C / (n+1)C = 10C at n=4 | (2n+2)C / (n+1)C = 15C | as mhc fused |
| xhc (N streams, k active) | a N + b k + 2 (C units, total) | 2x the forward | as mhc fused with n = N |

Every recompute also re-runs F's pre-norm of each rebuilt sub-layer (reads C, writes C; one kernel each).

xHC: two anchors fix the linear form: mHC's unfused 34C at N = k = n = 4 (8n + 2) and xHC's reported 73.5C at
N = 16, k = 4 (arXiv 2607.14530): a + b = 8 and 16a + 4b + 2 = 73.5, so a = 3.29 (dense reads over all N streams)
and b = 4.71 (sparse write-back over the k active ones) (derived). xHC-Flash (51C) is `fused=True`, which scales
the same kernels by 51/73.5. Mapping generation is O(k^3 C): 2 k C (k^2 + 2k) FLOPs per token, Sinkhorn on k x k.

Kernel boundaries follow the paper (§4.3.1): proj (Eq. 14-15, reads the nC state once), split, Sinkhorn, F_pre,
F_post,res; backward post_bwd, pre_apply_mix_bwd, sinkhorn_bwd, norm_fn_bwd; recompute one kernel per block of
L_r sub-layers plus F's norms. Every kernel is priced separately (memory curve + launch). The projection (and
its backward: dx and dphi, 2x the FLOPs) runs on TF32 tensor cores (phi TF32-rounded, mHC Eq. 10-13; TK
`round_to_tf32`, DeepGEMM `tf32_hc_prenorm_gemm`): class "matrix", dtype "tf32", the roofline of its FLOPs at
the tf32 peak with the matrix curve against its bytes. At 2 (n^2 + 2n) FLOPs per nC d bytes (24 FLOP/B at n=4,
bf16) it stays bandwidth-bound at realistic sizes on every built-in GPU (tests/costmodel/test_costmodel_audit).
xHC's projection is priced as before (a vector kernel, scaled with the xHC I/O anchors).

Single-pass mHC (`mhc-sp`; DeepSeek-V4.1 report §2.4.1 as described in NVIDIA-NeMo/Automodel PR #3855 and
Megatron-LM PR #7500; mhc.md §3): X_{l+1} = B_l X_l + C_l F_l(A_{l-1} X_l). A sub-layer's input mixing uses the
coefficient predicted one sub-layer earlier, so one pass over the n streams after F_l does F_l's residual
update, the next sub-layer's input mixing and the next coefficient prediction. Derivation of (2n+2)C:

| kernel | reads | writes | total |
| --- | --- | --- | --- |
| mhc.sp.pass (after F_l) | X_l (nC), y_l = F_l's output (C), A_l B_l C_l (coef) | X_{l+1} (nC), u_{l+1} = A_l X_{l+1}
(C), logits of X_{l+1} (coef) | (2n+2)C + 2 coef |
| mhc.sp.pass.bwd (its adjoint) | dX_{l+1} (nC), du_{l+1} (C), X_l (nC), y_l (C), dlogits, coefficients | dX_l (nC),
dy_l (C), their grads (coef) | (3n+3)C + 3 coef |
| split, Sinkhorn (and backward) | as mhc fused, on the logits the previous pass wrote | | O(n^2) fp32 |

The adjoint rule (a backward reads the gradients of what its forward wrote plus the forward inputs it needs,
writes the gradients of what its forward read) reproduces the fused mhc backward above, (3n+2)C + (3n+1)C + 3nC
for post_res, pre and proj. The (4n+4)C that single pass replaces is the fused mhc forward (4n+2)C plus F's
pre-norm (2C), which the V4.1 deployment kernel ("Mega-mHC", DeepGEMM, inference-only) also folds into its pass;
in training F's norm stays F's kernel here, as for every variant. No forward-plus-backward single-pass kernel is
released (Automodel PR #3855: pretraining keeps a multi-kernel implementation), so these are the bytes a fused
training kernel of this structure would move, a lower bound for today's multi-kernel training. The projection
sits inside the pass: the pass
is a tf32 "matrix" kernel, bandwidth-bound like mhc.proj. Recompute is the mhc fused one (x_l and u_l from x_l0,
the kept y and coefficients). Carried state between sub-layers: the input-mixing coefficient A_l, n fp32 values
per token. Across a pipeline-stage boundary the n-stream state (nC) and A_l cross (`ResidualSpec.carry_bytes`:
4n bytes per token on top of T n C d, both directions: dA_l goes back), and every stage starts with an entry
pass (`stage_entry`: read X and A, write u and the logits: (n+1)C; backward (3n+1)C, as mhc.pre.bwd, the
gradient of X accumulated in place). The first sub-layer of the pipeline mixes X_0 with a static coefficient
(an assumption: nothing earlier predicts it). The stage's last pass is priced as any other (the u and logits it
writes for a next sub-layer on another stage are recomputed there by the entry: C + coef per token and stage
over-counted, under 1/(L(2n+2)) of the stage's residual traffic). The contract at the pipeline's end is the last
pass's u (V4.1 folds the streams with the last sub-layer's input-mixing coefficient before the head): no kernel.

Activation memory (mhc.md §5, Table 3; what pipeline/runtime/stage.py and pipeline/runtime/recompute.py keep and
rebuild, checked against the runtime by the audit tests). F's own saved tensors (memory.sublayer_activation_elems)
include its norm input u_l and normed output h_l (2C). Without recompute the residual adds x_l (nC, plus the normed
nC state for the unfused forms), F's output y_l (C) and the coefficients. With recompute in blocks of r sub-layers every
variant, the plain residual included (the runtime recomputes whatever the config says, and DeepSeek-V3 §3.2.3
recomputes every RMSNorm in its baseline too), keeps the block input x_l0 (once per block: ceil(L/r) per
stage), y_l and the coefficients, and drops x_l (l >= 1), u_l and h_l: the recompute kernels above rebuild
them, F's norm included (F's core is never re-run). Transient while a block's backward runs: x_l (l >= 1),
u_l (the plain residual's u_l is x_l itself) and h_l of the block: ((n+2)r - n)C, (2r - 1)C for the plain residual.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from configs import residual_spec as rs
from costmodel.physics.ops import Kernel, vec

VARIANTS = rs.NAMES  # kernels.residual_spec: the one list
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
        v = rs.variant(self.variant)
        if v.takes_k and self.k is None:
            raise ValueError(f"xhc needs 1 <= k <= n active streams (got n={self.n}, k={self.k}); e.g. --n 16 --k 4")
        rs.check_shape(self.variant, self.n, self.k)
        if v.always_fused and not self.fused:
            raise ValueError(f"{self.variant} is one fused pass per sub-layer by definition; drop --unfused")

    @property
    def is_baseline(self) -> bool:
        return self.variant == "residual" or self.n == 1 and self.variant != "xhc"

    @property
    def unfused(self) -> bool:
        """Priced by mHC Table 2's separate ops (hc always; mhc and mhc-lite with fused=False)."""
        v = rs.variant(self.variant)
        return not self.is_baseline and (v.never_fused or (not self.fused and not v.takes_k))

    @property
    def width(self) -> int:
        """Residual-state width in units of C: what crosses a stage boundary per token."""
        return 1 if self.is_baseline else self.n

    @property
    def carry_bytes(self) -> int:
        """Bytes per token that cross a stage boundary besides the width x C state (each direction): mhc-sp's
        input-mixing coefficient A_l, n fp32 values (its gradient going back)."""
        return 4 * self.n if rs.variant(self.variant).carries_coefficient and not self.is_baseline else 0

    @property
    def num_mix(self) -> int:
        return rs.num_mix(self.variant, self.n, self.k)

    def coef_elems(self, d: int) -> float:
        """The fp32 coefficients of one sub-layer per token, in units of d-byte elements."""
        return 0.0 if self.is_baseline else 4 * self.num_mix / d

    def label(self) -> str:
        if self.is_baseline:
            return "residual (n=1)"
        extra = f", k={self.k}" if self.variant == "xhc" else ""
        v = rs.variant(self.variant)
        fused = "" if v.never_fused or v.always_fused else (" fused" if self.fused else " unfused")
        return f"{self.variant}{fused} (n={self.n}{extra})"

    @classmethod
    def baseline(cls) -> "ResidualSpec":
        return cls("residual", 1)


def _mem(name: str, elems_per_token: float, T: int, d: int, flops: float = 0.0, **kw) -> Kernel:
    return vec(name, elems_per_token * T * d, flops, group="mhc", **kw)


def _tf32(name: str, elems_per_token: float, T: int, d: int, flops: float, **kw) -> Kernel:
    """A kernel that contains the Eq. 14-15 projection: TF32 tensor cores, roofline against its bytes."""
    return Kernel(name, "matrix", flops, elems_per_token * T * d, "tf32", group="mhc", **kw)


def residual_kernels(spec: ResidualSpec, T: int, C: int, d: int, mlp: bool,
                     hp: bool) -> tuple[list[Kernel], list[Kernel], list[Kernel]]:
    """(before F, after F, backward) kernels of one sub-layer's residual side. `hp`: put the MLP-side post+res
    (and its backward, which feeds the combine/send) on the high-priority stream."""
    if spec.is_baseline:
        add = _mem("res.add", 3 * C, T, d, T * C)
        return [], [add], [replace(add, name="res.add.bwd")]
    n, t = spec.n, spec.sinkhorn_iters
    coef = spec.coef_elems(d)
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
    if spec.variant in ("mhc", "mhc-sp"):
        sink = vec("mhc.sinkhorn", 4 * 2 * n * n * T, 4 * t * n * n * T, group="mhc")
    elif spec.variant == "mhc-lite":
        nf = math.factorial(n)
        sink = vec("mhc.perm_mix", 4 * (nf + n * n) * T, (3 * nf + 2 * nf * n * n) * T, group="mhc")
    else:  # hc: tanh on the coefficients, folded into the split kernel
        sink = None
    split = vec("mhc.split", 4 * 2 * spec.num_mix * T, 4 * spec.num_mix * T, group="mhc")
    if spec.variant == "mhc-sp":
        # module docstring: one pass after F does the residual update, the next input mixing and the next
        # projection; split and Sinkhorn act on the logits the previous pass (or the stage entry) wrote
        pass_flops = ((2 * n * n + 2 * n) * C + 2 * n * C) * T + proj_flops
        sp = _tf32("mhc.sp.pass", (2 * n + 2) * C + 2 * coef, T, d, pass_flops, stream=post_stream)
        bwd = [_tf32("mhc.sp.pass.bwd", (3 * n + 3) * C + 3 * coef, T, d, 2 * pass_flops, stream=post_stream),
               replace(sink, name=sink.name + ".bwd", flops=2 * sink.flops, nbytes=2 * sink.nbytes)]
        return [split, sink], [sp], bwd
    if sink is not None and not spec.fused and spec.variant == "mhc":
        # eager Sinkhorn: exp, then per round a column sum, a divide, a row sum and a divide (launch-bound,
        # mhc.md §8: vllm-omni #7545, ~127 launches per call)
        sink = replace(sink, launches=4 * t + 2)
    proj = _tf32("mhc.proj", n * C + coef, T, d, proj_flops)
    if spec.unfused:
        # unfused, mHC Table 2: compute H (nC read), apply pre (nC in, C out), apply post (C in, nC out),
        # apply res (nC in, nC out), merge (2nC in, nC out); an unfused norm also writes the normed nC state
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
    pre = _mem("mhc.pre", (n + 1) * C, T, d, 2 * n * C * T)
    post = _mem("mhc.post_res", (2 * n + 1) * C, T, d, (2 * n * n + 2 * n) * C * T, stream=post_stream)
    bwd = [_mem("mhc.post_res.bwd", (3 * n + 2) * C + coef, T, d, 4 * n * n * C * T, stream=post_stream),
           _mem("mhc.pre.bwd", (3 * n + 1) * C, T, d, 4 * n * C * T),
           replace(sink, name=sink.name + ".bwd", flops=2 * sink.flops, nbytes=2 * sink.nbytes),
           _tf32("mhc.proj.bwd", 3 * n * C + coef, T, d, 2 * proj_flops)]
    return [proj, split, sink, pre], [post], bwd


def stage_entry(spec: ResidualSpec, T: int, C: int, d: int) -> tuple[list[Kernel], list[Kernel]]:
    """(forward, backward) kernels at the start of every stage (after the pipeline's expand): mhc-sp's entry
    pass, which mixes the received state with the carried coefficient and predicts the first sub-layer's
    coefficients (module docstring); nothing for the other variants, whose first sub-layer starts from x alone.
    The backward runs after the stage's first sub-layer's input gradient, last in the I chain."""
    if spec.variant != "mhc-sp" or spec.is_baseline:
        return [], []
    n, coef, carry = spec.n, spec.coef_elems(d), spec.carry_bytes / d
    flops = (2 * n * C + 2 * n * C * spec.num_mix) * T
    fwd = _tf32("mhc.sp.entry", (n + 1) * C + carry + coef, T, d, flops)
    bwd = _tf32("mhc.sp.entry.bwd", (3 * n + 1) * C + 2 * carry + coef, T, d, 2 * flops)
    return [fwd], [bwd]


def recompute_kernels(spec: ResidualSpec, T: int, C: int, d: int, sublayers: int) -> list[Kernel]:
    """Rebuild one recompute block of `sublayers` (r) sub-layers before its backward (module docstring): one
    kernel for the residual stream (x_l for l >= 1 and, for mHC, u_l = H_pre x_l, from the kept x_l0, y_l and
    coefficients; the unfused forms redo their pre/post/res/merge ops), then F's norm of every sub-layer
    (reads u_l, writes h_l). F's core is never re-run."""
    r = sublayers
    if r <= 0:
        return []
    prefix = "res" if spec.is_baseline else "mhc"
    norms = [vec(f"{prefix}.recompute.norm", d * 2 * T * C, 4 * T * C, group="recompute") for _ in range(r)]
    n, w = spec.n, spec.width
    if spec.is_baseline:  # x_l = x_{l-1} + y_{l-1}; u_l is x_l itself
        if r == 1:
            return norms
        return [vec("res.recompute", d * T * (C + 2 * (r - 1) * C), (r - 1) * C * T, group="recompute")] + norms
    if spec.unfused:
        elems = r * ((n + 1) * C + 2 * n * C + 3 * n * C + (n + 1) * C) + n * C
        flops = r * (4 * n * C + 2 * n * n * C + n * C) * T
    else:
        elems = w * C + (r - 1) * C + r * spec.coef_elems(d) + (r - 1) * w * C + r * C
        flops = r * ((2 * n * n + 2 * n) * C + 2 * n * C) * T
    return [Kernel("mhc.recompute", "vector", flops, elems * T * d, launches=1, group="recompute")] + norms


def recompute_kernel(spec: ResidualSpec, T: int, C: int, d: int, sublayers: int) -> Kernel | None:
    """`recompute_kernels` summed into one kernel (bytes, FLOPs and launches), for callers that price one op per
    block; pricing each of them (recompute_kernels) is the exact form."""
    ks = recompute_kernels(spec, T, C, d, sublayers)
    if not ks:
        return None
    return Kernel(ks[0].name, "vector", sum(k.flops for k in ks), sum(k.nbytes for k in ks),
                  launches=sum(k.launches for k in ks), group="recompute")


def stack_ends(spec: ResidualSpec, T: int, C: int, d: int) -> tuple[list[Kernel], list[Kernel]]:
    """Expand at a pipeline's first stage (copy h into n streams) and contract at its last (mean over streams),
    forward kernels; their backwards cost the same bytes. mhc-sp has no contract: the head reads the last pass's
    u (the streams folded with the last input-mixing coefficient)."""
    if spec.is_baseline:
        return [], []
    n = spec.n
    contract = [] if spec.variant == "mhc-sp" else [_mem("mhc.contract", (n + 1) * C, T, d)]
    return [_mem("mhc.expand", (n + 1) * C, T, d)], contract


def residual_activation_elems(spec: ResidualSpec, C: int, d: int, L: int, L_r: int | None) -> float:
    """Activation elements per token a stage of L sub-layers keeps for backward on its residual side, on top of
    its sub-layers' own (which count F's norm input and output, 2C each); L_r: recompute block or None (module
    docstring). Negative where recompute drops more of F's norm tensors than the residual keeps."""
    if L <= 0:
        return 0.0
    coef = spec.coef_elems(d)
    carry = spec.carry_bytes / d  # mhc-sp: the received coefficient, an input of the entry pass's backward
    if L_r is None:
        if spec.is_baseline:
            return 0.0
        state = 2 * spec.n if spec.unfused else spec.n
        return L * ((state + 1) * C + coef) + carry
    blocks = math.ceil(L / L_r)
    return blocks * spec.width * C + L * (C + coef) - L * 2 * C + carry


def recompute_transient_elems(spec: ResidualSpec, C: int, L_r: int) -> float:
    """Elements per token rebuilt for one block of L_r sub-layers, alive while its backward runs: x_l (l >= 1),
    u_l (not for the plain residual, whose u_l is x_l), h_l, and the unfused forms' normed nC state."""
    u = 0 if spec.is_baseline else C
    normed = spec.n * C if spec.unfused else 0
    return (L_r - 1) * spec.width * C + L_r * (u + C + normed)


def mhc_params_per_sublayer(spec: ResidualSpec, C: int) -> float:
    """phi (nC x mix, fp32), bias (mix) and three alphas."""
    if spec.is_baseline:
        return 0.0
    return spec.n * C * spec.num_mix + spec.num_mix + 3
