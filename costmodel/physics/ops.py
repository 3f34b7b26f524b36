"""Per-op work of one Transformer block: FLOPs and bytes of every kernel, for the F, I and W passes.

Shape letters: T tokens per micro-batch (micro-batch size x sequence), C hidden, q = heads x head_dim (q/k/v width),
H dense SwiGLU hidden, E routed experts, k top-k, He expert hidden, V vocabulary, d bytes per activation element.

Conventions (costmodel.md §2.1):
* GEMM (MxK)(KxN): 2MKN FLOPs, d(MK + KN + MN) bytes. A linear layer's backward is two GEMMs of the forward's
  size: the input-grad (dgrad) belongs to I, the weight-grad (wgrad) to W.
* Attention core (FlashAttention-style, causal): forward 2 * b * s^2 * q FLOPs (QK^T and PV, halved by the causal
  mask), backward 2.5x the forward (FlashAttention-2: five matmuls against two, one of them the recomputed
  scores; the spec's attention_bwd_factor, a sensitivity row); bytes = reading q, k, v and writing o (forward),
  plus do, dq, dk, dv (backward). No T x T matrix.
* SwiGLU: gate+up GEMM (C -> 2H), silu(g) * u elementwise, down GEMM (H -> C): 6 T C H FLOPs forward.
* MoE (DeepSeek style): router GEMM C -> E, top-k, permute, expert-parallel dispatch (all-to-all when EP > 1),
  grouped expert GEMMs over T k token copies, combine, unpermute; shared experts are dense SwiGLUs that may run
  while the dispatch is in flight (their own dependency on the router input, not on the dispatch).
  Per-expert GEMM size for the efficiency curve: T k EP / E tokens (balanced routing).
* RMSNorm: one kernel reading and writing T C (forward), reading x, dy and writing dx (backward).
* MLA (DeepSeek-V2/V3 multi-head latent attention, model.mla): q = q_b(norm(q_a(x))), [k_nope, v] =
  kv_b(norm(kv_a(x))) with kv_a also giving the shared rotary key; the core runs h heads of query/key width
  nope + rope and value width v: causal forward FLOPs s^2 h (d_qk + d_v) per sequence. Only the latents are kept
  for backward: the up-projections q_b and kv_b run again in I (DeepSeek-V3 §3.3.3, "recomputation of RMSNorm
  and MLA up-projection").
* FP8 (train.fp8, DeepSeek-V3 §3.3): the linear layers' GEMMs (attention projections, dense and expert SwiGLUs,
  shared experts; not the router, the head, the attention core or the embedding) run at the fp8 tensor-core rate
  on 1-byte operands. Their overhead is the quantisation of each activation operand, a memory pass reading d and
  writing 1 byte plus one fp32 scale per 128 elements (`Kernel.quant_bytes`, priced as a serial pass before the
  GEMM): the A operand in F and dgrad, both operands in wgrad (re-quantised in the transposed 128 x 1 tiles).
  Weights are quantised once per optimizer step (not priced). The dispatch carries FP8 tokens with their scales,
  and so does the combine's backward (the activation gradient before the experts' down projection); the combine
  and the dispatch's backward stay in the activation dtype (V3 §3.3.4).
* Permute: one memory pass of the token copies on each side of the exchange (`moe.permute`, `moe.unpermute` and
  their backward). With DeepEP the sender's permute is fused into the dispatch (it reads token rows by index), but
  the receiver then groups the copies per local expert for the grouped GEMM's contiguous layout, a pass of the same
  bytes; likewise the combine reduces the k copies itself while the expert side reorders them first. So both
  dispatchers price the same passes: fusing moves a pass, it does not remove it.
* MTP (model.mtp_depth, DeepSeek-V3 §2.2): each module on the pipeline's last stage gathers the next tokens'
  embeddings, normalises both inputs, projects 2C -> C, runs one more MoE block and the shared head again.
The residual connection itself (plain add, or the mHC kernels around the sub-layer) is priced in mhc_cost.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from configs import RunConfig

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
FP8_SCALE_BYTES = 4 / 128  # one fp32 scale per 1 x 128 tile (V3 §3.3.2)


@dataclass(frozen=True)
class Kernel:
    """One kernel (or one eager op) to price.

    cls: "matrix" (tensor-core GEMM or attention core), "vector" (elementwise/reduction), "memory" (pure copy),
    "a2a" (expert-parallel all-to-all: bytes per rank), "sync" (launch cost only).
    group: what it belongs to for the breakdown: model, mhc, recompute, a2a, embed, head.
    stream: compute, hp (high-priority compute) or comm. deps: offsets (negative) of the ops in the same chain it
    waits for; (-1,) = the previous op.
    """

    name: str
    cls: str
    flops: float = 0.0
    nbytes: float = 0.0
    dtype: str = "bf16"
    launches: int = 1
    group: str = "model"
    stream: str = "compute"
    deps: tuple[int, ...] = (-1,)
    preemptible: bool = True
    quant_bytes: float = 0.0  # FP8: bytes of the quantisation pass before the GEMM (module docstring)
    op: str = "gemm"  # which efficiency curve a matrix kernel runs on: gemm, attn_fwd, attn_bwd (HardwareSpec)

    def scaled(self, factor: float) -> "Kernel":
        return replace(self, flops=self.flops * factor, nbytes=self.nbytes * factor,
                       quant_bytes=self.quant_bytes * factor)


def gemm(name: str, m: float, k: float, n: float, d: int, dtype: str, **kw) -> Kernel:
    """(m x k)(k x n). Large cuBLAS GEMMs do not yield SMs to a high-priority stream (gpu.md §6)."""
    return Kernel(name, "matrix", 2.0 * m * k * n, d * (m * k + k * n + m * n), dtype, preemptible=False, **kw)


def linear(name: str, m: float, k: float, n: float, s: "Shape", wgrad: bool = False, **kw) -> Kernel:
    """A linear layer's GEMM (m x k)(k x n): in FP8 when the run says so (module docstring), else `gemm`."""
    if not s.fp8:
        return gemm(name, m, k, n, s.d, s.dtype, **kw)
    q = s.d + 1 + FP8_SCALE_BYTES
    return Kernel(name, "matrix", 2.0 * m * k * n, m * k + k * n + s.d * m * n, "fp8", preemptible=False,
                  quant_bytes=q * (m * k + (k * n if wgrad else 0)), **kw)


def vec(name: str, nbytes: float, flops: float = 0.0, launches: int = 1, **kw) -> Kernel:
    return Kernel(name, "vector", flops, nbytes, launches=launches, **kw)


@dataclass(frozen=True)
class Shape:
    """What the per-op formulas need from a RunConfig."""

    T: int
    seq: int
    mbs: int
    C: int
    q: int
    H: int
    V: int
    d: int
    dtype: str  # "bf16" or "fp32": which peak the GEMMs run at
    moe: tuple[int, int, int, int] | None  # (E, top_k, shared, He)
    first_dense: int
    ep: int
    heads: int = 1
    mla: tuple[int, int, int, int, int] | None = None  # (q_lora, kv_lora, rope, nope, v)
    fp8: bool = False
    mtp: int = 0
    attn_bwd: float = 2.5  # attention core backward FLOPs over forward (HardwareSpec.attention_bwd_factor)

    @classmethod
    def of(cls, cfg: RunConfig) -> "Shape":
        m, p = cfg.model, cfg.parallel
        d = DTYPE_BYTES[cfg.train.dtype]
        moe = None if m.moe is None else (m.moe.num_experts, m.moe.top_k, m.moe.num_shared, m.moe.expert_hidden)
        a = m.mla
        mla = None if a is None else (a.q_lora_rank, a.kv_lora_rank, a.qk_rope_head_dim, a.qk_nope_head_dim,
                                      a.v_head_dim)
        return cls(T=p.tokens_per_microbatch, seq=p.seq_len, mbs=p.microbatch_size, C=m.hidden,
                   q=m.num_heads * m.head_dim, H=m.mlp_hidden, V=m.vocab_size, d=d,
                   dtype="fp32" if d == 4 else "bf16", moe=moe,
                   first_dense=0 if m.moe is None else m.moe.first_dense_blocks, ep=p.expert_parallel,
                   heads=m.num_heads, mla=mla, fp8=cfg.train.fp8, mtp=m.mtp_depth)


@dataclass
class SubLayerWork:
    """Kernels of one sub-layer (attention or MLP), per pass, in execution order."""

    kind: str  # "attn" | "mlp" | "moe"
    F: list[Kernel] = field(default_factory=list)
    I: list[Kernel] = field(default_factory=list)  # noqa: E741
    W: list[Kernel] = field(default_factory=list)


def attention(s: Shape) -> SubLayerWork:
    if s.mla is not None:
        return mla_attention(s)
    T, C, q, d, dt = s.T, s.C, s.q, s.d, s.dtype
    core_f = 2.0 * s.mbs * s.seq * s.seq * q
    io = d * 4 * T * q
    w = SubLayerWork("attn")
    w.F = [vec("attn.norm", d * 2 * T * C, 4 * T * C),
           linear("attn.qkv", T, C, 3 * q, s),
           vec("attn.rope", d * 4 * T * q, 6 * T * q),
           Kernel("attn.core", "matrix", core_f, io, dt, op="attn_fwd"),
           linear("attn.out", T, q, C, s)]
    w.I = [linear("attn.out.dgrad", T, C, q, s),
           Kernel("attn.core.bwd", "matrix", s.attn_bwd * core_f, 2 * io, dt, op="attn_bwd"),
           vec("attn.rope.bwd", d * 4 * T * q, 6 * T * q),
           linear("attn.qkv.dgrad", T, 3 * q, C, s),
           vec("attn.norm.bwd", d * 3 * T * C, 6 * T * C)]
    w.W = [linear("attn.out.wgrad", q, T, C, s, wgrad=True),
           linear("attn.qkv.wgrad", C, T, 3 * q, s, wgrad=True)]
    return w


def mla_attention(s: Shape) -> SubLayerWork:
    """Multi-head latent attention (module docstring): the latent projections, the up-projections (run again in
    I from the kept latents), the core of h heads with query/key width nope + rope and value width v."""
    T, C, d, dt, h = s.T, s.C, s.d, s.dtype, s.heads
    ql, kvl, rope, nope, v = s.mla
    qk = nope + rope
    core_f = 1.0 * s.mbs * s.seq * s.seq * h * (qk + v)
    io = d * T * h * (2 * qk + 2 * v)  # q, k, v read, o written
    up = [linear("attn.q_b", T, ql, h * qk, s), linear("attn.kv_b", T, kvl, h * (nope + v), s)]
    w = SubLayerWork("attn")
    w.F = [vec("attn.norm", d * 2 * T * C, 4 * T * C),
           linear("attn.q_a", T, C, ql, s), vec("attn.q_norm", d * 2 * T * ql, 4 * T * ql), up[0],
           linear("attn.kv_a", T, C, kvl + rope, s), vec("attn.kv_norm", d * 2 * T * kvl, 4 * T * kvl), up[1],
           vec("attn.rope", d * 4 * T * (h + 1) * rope, 6 * T * (h + 1) * rope),
           Kernel("attn.core", "matrix", core_f, io, dt, op="attn_fwd"),
           linear("attn.out", T, h * v, C, s)]
    w.I = [linear("attn.out.dgrad", T, C, h * v, s),
           vec("attn.q_norm.recompute", d * 2 * T * ql, 4 * T * ql), replace(up[0], name="attn.q_b.recompute"),
           vec("attn.kv_norm.recompute", d * 2 * T * kvl, 4 * T * kvl), replace(up[1], name="attn.kv_b.recompute"),
           vec("attn.rope.recompute", d * 4 * T * (h + 1) * rope, 6 * T * (h + 1) * rope),
           Kernel("attn.core.bwd", "matrix", s.attn_bwd * core_f, 2 * io, dt, op="attn_bwd"),
           vec("attn.rope.bwd", d * 4 * T * (h + 1) * rope, 6 * T * (h + 1) * rope),
           linear("attn.kv_b.dgrad", T, h * (nope + v), kvl, s), vec("attn.kv_norm.bwd", d * 3 * T * kvl, 6 * T * kvl),
           linear("attn.kv_a.dgrad", T, kvl + rope, C, s),
           linear("attn.q_b.dgrad", T, h * qk, ql, s), vec("attn.q_norm.bwd", d * 3 * T * ql, 6 * T * ql),
           linear("attn.q_a.dgrad", T, ql, C, s),
           vec("attn.norm.bwd", d * 3 * T * C, 6 * T * C)]
    w.W = [linear("attn.out.wgrad", h * v, T, C, s, wgrad=True),
           linear("attn.kv_b.wgrad", kvl, T, h * (nope + v), s, wgrad=True),
           linear("attn.kv_a.wgrad", C, T, kvl + rope, s, wgrad=True),
           linear("attn.q_b.wgrad", ql, T, h * qk, s, wgrad=True),
           linear("attn.q_a.wgrad", C, T, ql, s, wgrad=True)]
    return w


def dense_mlp(s: Shape, hidden: int | None = None, prefix: str = "mlp") -> SubLayerWork:
    T, C, H, d = s.T, s.C, hidden or s.H, s.d
    w = SubLayerWork("mlp")
    w.F = [vec(f"{prefix}.norm", d * 2 * T * C, 4 * T * C),
           linear(f"{prefix}.gate_up", T, C, 2 * H, s),
           vec(f"{prefix}.act", d * 3 * T * H, 4 * T * H),
           linear(f"{prefix}.down", T, H, C, s)]
    w.I = [linear(f"{prefix}.down.dgrad", T, C, H, s),
           vec(f"{prefix}.act.bwd", d * 5 * T * H, 8 * T * H),
           linear(f"{prefix}.gate_up.dgrad", T, 2 * H, C, s),
           vec(f"{prefix}.norm.bwd", d * 3 * T * C, 6 * T * C)]
    w.W = [linear(f"{prefix}.down.wgrad", H, T, C, s, wgrad=True),
           linear(f"{prefix}.gate_up.wgrad", C, T, 2 * H, s, wgrad=True)]
    return w


def _experts(name: str, tokens: float, C: int, He: int, m_e: float, s: Shape, quant: float = 0.0) -> Kernel:
    """Grouped SwiGLU expert GEMMs over `tokens` token copies; efficiency from one expert's GEMM size (m_e tokens).
    FP8: 1-byte operands, outputs in the activation dtype, `quant` elements per copy quantised first (the dispatch
    already carries FP8 tokens: in F only the down projection's input is)."""
    flops = 6.0 * tokens * C * He
    weights = 3 * C * He * max(1.0, tokens / max(m_e, 1.0))
    if not s.fp8:
        nbytes = s.d * (3 * tokens * C + 3 * tokens * He + weights)
        return Kernel(name, "matrix", flops, nbytes, s.dtype, preemptible=False)
    nbytes = 2 * tokens * C + s.d * tokens * C + 2 * tokens * He + s.d * tokens * He + weights
    return Kernel(name, "matrix", flops, nbytes, "fp8", preemptible=False,
                  quant_bytes=(s.d + 1 + FP8_SCALE_BYTES) * tokens * quant)


def _chain(items: list[tuple[Kernel, tuple[int, ...] | None]]) -> list[Kernel]:
    """Kernels with absolute dependency indices (None = previous op) -> relative `deps`."""
    out = []
    for i, (kern, deps) in enumerate(items):
        out.append(kern if deps is None else replace(kern, deps=tuple(j - i for j in deps)))
    return out


def moe(s: Shape) -> SubLayerWork:
    E, k, ns, He = s.moe
    T, C, d, dt, ep = s.T, s.C, s.d, s.dtype, s.ep
    copies = T * k
    m_e = copies * ep / E  # tokens one local expert sees
    a2a_bytes = d * copies * C  # token copies leaving (and arriving at) one rank, per direction
    dispatch_bytes = (1 + FP8_SCALE_BYTES) * copies * C if s.fp8 else a2a_bytes  # FP8 tokens and their scales
    shared = dense_mlp(s, ns * He, "moe.shared") if ns else SubLayerWork("mlp")
    a2a = ep > 1
    comm = dict(group="a2a", stream="comm")
    # forward: norm, router, top-k, permute, [dispatch], shared experts (need only the normed input, so they
    # run under the dispatch), routed experts, [combine], unpermute (+ shared output)
    f: list[tuple[Kernel, tuple[int, ...] | None]] = [
        (vec("moe.norm", d * 2 * T * C, 4 * T * C), None), (gemm("moe.router", T, C, E, d, dt), None),
        (vec("moe.topk", 4 * 2 * T * E, 8 * T * E), None), (Kernel("moe.permute", "memory", 0, 2 * a2a_bytes), None)]
    if a2a:
        f.append((Kernel("moe.dispatch", "a2a", 0, dispatch_bytes, **comm), None))
    routed_in = len(f) - 1
    sh = []
    for j, kern in enumerate(shared.F[1:]):
        sh.append(len(f))
        f.append((kern, (0,) if j == 0 else None))
    f.append((_experts("moe.experts", copies, C, He, m_e, s, He if a2a else C + He), (routed_in,)))
    if a2a:
        f.append((Kernel("moe.combine", "a2a", 0, a2a_bytes, **comm), None))
    f.append((Kernel("moe.unpermute", "memory", 0, 2 * a2a_bytes + d * T * C),
              (len(f) - 1,) + ((sh[-1],) if sh else ())))
    # backward (I): unpermute.bwd, [combine.bwd], shared dgrad (under the combine), experts dgrad,
    # [dispatch.bwd], permute.bwd, top-k.bwd, router dgrad, norm.bwd (+ shared input-grad)
    b: list[tuple[Kernel, tuple[int, ...] | None]] = [
        (Kernel("moe.unpermute.bwd", "memory", 0, 2 * a2a_bytes + d * T * C), None)]
    if a2a:  # the gradient going back to the experts: FP8 as the dispatch (module docstring)
        b.append((Kernel("moe.combine.bwd", "a2a", 0, dispatch_bytes, **comm), None))
    routed_grad = len(b) - 1
    sh = []
    for j, kern in enumerate(shared.I[:-1]):
        sh.append(len(b))
        b.append((kern, (0,) if j == 0 else None))
    b.append((_experts("moe.experts.dgrad", copies, C, He, m_e, s, C + He), (routed_grad,)))
    if a2a:
        b.append((Kernel("moe.dispatch.bwd", "a2a", 0, a2a_bytes, **comm), None))
    b += [(Kernel("moe.permute.bwd", "memory", 0, 2 * a2a_bytes), None),
          (vec("moe.topk.bwd", 4 * 3 * T * E, 8 * T * E), None), (gemm("moe.router.dgrad", T, E, C, d, dt), None)]
    b.append((vec("moe.norm.bwd", d * 3 * T * C, 6 * T * C), (len(b) - 1,) + ((sh[-1],) if sh else ())))
    w = SubLayerWork("moe", F=_chain(f), I=_chain(b))
    w.W = [_experts("moe.experts.wgrad", copies, C, He, m_e, s, 2 * (C + He)),
           gemm("moe.router.wgrad", C, T, E, d, dt)]
    w.W += shared.W
    return w


def block_work(s: Shape, block: int) -> tuple[SubLayerWork, SubLayerWork]:
    """(attention, MLP-or-MoE) work of Transformer block `block` (0-based; the first `first_dense` are dense)."""
    mlp = dense_mlp(s) if s.moe is None or block < s.first_dense else moe(s)
    return attention(s), mlp


def embedding(s: Shape) -> SubLayerWork:
    """Token embedding on a pipeline's first stage: a gather forward, a scatter-add into the table in W."""
    d, T, C = s.d, s.T, s.C
    w = SubLayerWork("embed")
    w.F = [Kernel("embed.gather", "memory", 0, d * 2 * T * C, group="embed")]
    w.W = [Kernel("embed.scatter_add", "memory", 0, d * 3 * T * C, group="embed")]
    return w


def head(s: Shape) -> SubLayerWork:
    """Final norm, LM head GEMM and cross-entropy (fp32 logits) on a pipeline's last stage."""
    d, T, C, V, dt = s.d, s.T, s.C, s.V, s.dtype
    w = SubLayerWork("head")
    w.F = [vec("head.norm", d * 2 * T * C, 4 * T * C, group="head"),
           gemm("head.logits", T, C, V, d, dt, group="head"),
           vec("head.xent", 4 * 2 * T * V + d * T * V, 5 * T * V, group="head")]
    w.I = [vec("head.xent.bwd", 4 * T * V + d * T * V, 3 * T * V, group="head"),
           gemm("head.dgrad", T, V, C, d, dt, group="head"),
           vec("head.norm.bwd", d * 3 * T * C, 6 * T * C, group="head")]
    w.W = [gemm("head.wgrad", C, T, V, d, dt, group="head")]
    return w


def mtp_prelude(s: Shape) -> SubLayerWork:
    """One MTP module's entry on the last stage (module docstring): the next tokens' embeddings, an RMSNorm on each
    input, the 2C -> C projection. Its block and its pass through the shared head are priced as a block and a
    head (pricing.py)."""
    d, T, C = s.d, s.T, s.C
    w = SubLayerWork("mtp")
    w.F = [Kernel("mtp.embed.gather", "memory", 0, d * 2 * T * C, group="head"),
           vec("mtp.norms", d * 4 * T * C, 8 * T * C, group="head"),
           linear("mtp.proj", T, 2 * C, C, s, group="head")]
    w.I = [linear("mtp.proj.dgrad", T, C, 2 * C, s, group="head"),
           vec("mtp.norms.bwd", d * 6 * T * C, 12 * T * C, group="head")]
    w.W = [linear("mtp.proj.wgrad", 2 * C, T, C, s, wgrad=True, group="head"),
           Kernel("mtp.embed.scatter_add", "memory", 0, d * 3 * T * C, group="head")]
    return w


def attention_params(cfg: RunConfig) -> float:
    """Parameters of one attention sub-layer (its RMSNorm included): 4 C q for multi-head attention; MLA's latent
    projections, their norms and up-projections, and the output projection."""
    m = cfg.model
    C, a, h = m.hidden, m.mla, m.num_heads
    if a is None:
        return 4 * C * m.num_heads * m.head_dim + C
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    return (C * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * h * qk
            + C * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
            + a.kv_lora_rank * h * (a.qk_nope_head_dim + a.v_head_dim) + h * a.v_head_dim * C + C)


def mtp_params(cfg: RunConfig, ep: int) -> float:
    """Parameters of the MTP modules (model.mtp_depth) on the last stage, routed experts split over EP: per module
    two RMSNorms, the 2C -> C projection and one MoE block (the embedding and head are shared)."""
    C = cfg.model.hidden
    return cfg.model.mtp_depth * (2 * C + 2 * C * C + block_params(cfg, cfg.model.num_blocks, ep))


def block_params(cfg: RunConfig, block: int, ep: int) -> float:
    """Parameters of one block held by one rank (routed experts split over EP)."""
    m = cfg.model
    C = m.hidden
    attn = attention_params(cfg)
    if m.moe is None or block < m.moe.first_dense_blocks:
        return attn + 3 * C * m.mlp_hidden + C
    e = m.moe
    return attn + C + C * e.num_experts + 3 * C * e.expert_hidden * (e.num_experts / ep + e.num_shared)


def forward_flops_per_token(cfg: RunConfig, causal: bool = True) -> float:
    """Model forward FLOPs per token (all blocks + head), for reports (training ~ 3x). `causal`: the attention
    core as a causal kernel computes it (half of QK^T and PV, as the pricing does); False: PaLM's convention
    (Chowdhery et al. 2022, App. B: 12 L H Q T per token for training counts the full s x s score matrix, causal
    or not), i.e. the core counted twice."""
    s = Shape.of(cfg)
    scale = {"attn.core": 1.0 if causal else 2.0}

    def matmuls(work) -> float:
        return sum(k.flops * scale.get(k.name, 1.0) for k in work.F if k.cls == "matrix")

    per_kind: dict[bool, list[float]] = {}  # block_work reads the index only to tell dense from MoE

    def block(b: int) -> list[float]:
        dense = s.moe is None or b < s.first_dense
        got = per_kind.get(dense)
        if got is None:
            got = per_kind[dense] = [matmuls(w) for w in block_work(s, b)]
        return got

    # the same terms added in the same order as one walk over every block: the same float
    total = sum(v for b in range(cfg.model.num_blocks) for v in block(b)) + matmuls(head(s))
    mtp = sum(matmuls(w) for w in block_work(s, cfg.model.num_blocks) + (head(s), mtp_prelude(s)))
    return (total + s.mtp * mtp) / s.T
