"""The model: embedding -> expand to n streams -> blocks -> contract -> norm -> head.

Shape letters: T tokens of a micro-batch (batch x sequence, flattened), S sequence length, n residual streams,
C hidden, H heads, D head dim, E routed experts, V vocabulary.

A block is two sub-layers (attention, then MLP or MoE), each an `F` = pre-norm + core wrapped in
`kernels.MHCSublayer` of the configured residual variant (n = 1 'residual' is the baseline x + F(x)). Global
sub-layer index l = 2b (attention of block b) and 2b + 1 (its MLP). Every piece is built under its own seed
(`seeded(seed, tag)`), so a pipeline stage that builds only its blocks holds exactly the parameters of the
single-process model, and DualPipe's two copies of a block are identical.

Linear layers are `DeferLinear` (B/W split); the norm is a small autograd function that saves only its input
and 1/rms, like fused norm kernels, so the activations it holds are exactly mhc.md Table 3's H_pre x_l.
Statistics (norm, router softmax, loss) run in fp32, or fp64 when the activations are fp64 (`acc_dtype`).

MoE: tokens are grouped by expert with one stable argsort (no per-expert `nonzero`), and the routed experts run
through `pipeline.distributed.expert.ExpertComm`, which is the identity on one rank and the all-to-all dispatch/combine
of expert parallelism on an EP group; a rank then holds only its E / EP experts, built under the same per-expert
seeds as the single-process model (parameter names `...experts.<global id>...` on every layout).
"""
from __future__ import annotations

import contextlib
import hashlib

import torch
import torch.nn.functional as F_
from torch import nn

from kernels import MHCSublayer, StreamExpand, contract
from kernels import residual_spec as rs
from kernels import single_pass
from kernels.xhc import XHCSublayer

from pipeline.weight_grad import DeferLinear, WeightGradStore, as_dtype

NORM_EPS = 1e-6


@contextlib.contextmanager
def seeded(seed: int, tag: str):
    """Build parameters under a seed derived from (seed, tag), without touching the caller's RNG state."""
    digest = hashlib.sha256(f"{seed}/{tag}".encode()).digest()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
        yield


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Dtype of statistics and reductions: fp64 for fp64 activations, fp32 otherwise."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


class _RMSNormFn(torch.autograd.Function):
    """y = x / rms(x) * w over the last dim; saves x and 1/rms only (fp32 statistics, fp64 for fp64 x)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        acc = acc_dtype(x)
        xf = as_dtype(x, acc)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return as_dtype(xf * rstd * as_dtype(weight, acc), x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        acc = rstd.dtype
        xf, dyf, wf = as_dtype(x, acc), as_dtype(dy, acc), as_dtype(weight, acc)
        xhat = xf * rstd
        dxhat = dyf * wf
        dx = rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
        dw = (dyf * xhat).reshape(-1, x.shape[-1]).sum(0)
        return as_dtype(dx, x.dtype), as_dtype(dw, weight.dtype), None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = NORM_EPS):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFn.apply(x, self.weight, self.eps)


class Attention(nn.Module):
    """Causal multi-head self-attention core [T, C] -> [T, C]; T = batch x S, sequences attend within themselves."""

    def __init__(self, hidden: int, num_heads: int, head_dim: int, seq_len: int, store: WeightGradStore | None):
        super().__init__()
        self.num_heads, self.head_dim, self.seq_len = num_heads, head_dim, seq_len
        self.wqkv = DeferLinear(hidden, 3 * num_heads * head_dim, store)
        self.wo = DeferLinear(num_heads * head_dim, hidden, store)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        t = h.shape[0]
        if t % self.seq_len:
            raise ValueError(f"attention got {t} tokens, not a multiple of seq_len={self.seq_len}")
        hh, d = self.num_heads, self.head_dim
        qkv = self.wqkv(h).view(t // self.seq_len, self.seq_len, 3, hh, d).permute(2, 0, 3, 1, 4)  # [3, B, H, S, D]
        o = F_.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)  # [B, H, S, D]
        return self.wo(o.transpose(1, 2).reshape(t, hh * d))


class SwiGLU(nn.Module):
    """w2(silu(w1 h) * w3 h), [.., C] -> [.., C]; w1 and w3 share one GEMM."""

    def __init__(self, hidden: int, ffn: int, store: WeightGradStore | None):
        super().__init__()
        self.ffn = ffn
        self.w13 = DeferLinear(hidden, 2 * ffn, store)
        self.w2 = DeferLinear(ffn, hidden, store)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        a, b = self.w13(h).split(self.ffn, dim=-1)
        return self.w2(F_.silu(a) * b)


class MoE(nn.Module):
    """Mixture of experts: softmax router, top-k routed SwiGLU experts (weights renormalised over the chosen k)
    plus always-on shared experts (one SwiGLU of num_shared x expert_hidden). No capacity limit, so every token's
    output depends on that token only and neither micro-batching nor expert parallelism changes the math.

    The T*k (token, expert) slots are sorted by expert (stable argsort), their rows gathered, and `comm.routed`
    runs them through the experts (here, or on the EP ranks that hold them) and returns one output row per slot in
    the same order; the outputs are weighted and summed back per token with one index_add."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, num_shared: int, expert_hidden: int,
                 store: WeightGradStore | None, *, seed: int = 0, tag: str = "moe", comm=None, layer: int = 0):
        super().__init__()
        self.top_k, self.num_experts, self.layer = top_k, num_experts, layer
        self.comm = comm  # pipeline.distributed.expert.ExpertComm, or None: every expert here, nothing exchanged
        # EP=1: counts -> a reader of them as a host list; the runtime passes a bounded, early one for CUDA
        # (pipeline.distributed.expert.start_count_read); None reads them where they are needed
        self.count_reader = None
        ep_size, ep_rank = (1, 0) if comm is None else (comm.size, comm.rank)
        self.num_local = num_experts // ep_size
        self.first_local = ep_rank * self.num_local
        with seeded(seed, f"{tag}/router"):
            self.router = DeferLinear(hidden, num_experts, store)
        experts = {}
        for e in range(self.first_local, self.first_local + self.num_local):
            with seeded(seed, f"{tag}/expert{e}"):
                experts[str(e)] = SwiGLU(hidden, expert_hidden, store)
        self.experts = nn.ModuleDict(experts)
        self.shared = None
        if num_shared:
            with seeded(seed, f"{tag}/shared"):
                self.shared = SwiGLU(hidden, num_shared * expert_hidden, store)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(h).to(acc_dtype(h)), dim=-1)  # [T, E]
        weight, chosen = probs.topk(self.top_k, dim=-1)  # [T, k]
        weight = (weight / weight.sum(-1, keepdim=True)).to(h.dtype)
        slots = chosen.reshape(-1)  # [T*k] expert of each (token, choice)
        order = torch.argsort(slots, stable=True)  # slots grouped by expert, hence by EP rank
        tok = torch.div(order, self.top_k, rounding_mode="floor")
        counts = slots.new_zeros(self.num_experts).index_add_(0, slots, torch.ones_like(slots))  # [E], no host sync
        local = self.comm is None or not self.comm.exchanging
        # EP=1: the sizes' copy to the host starts before the shared expert is queued, so the host waits for the
        # counts alone while the GPU runs the shared expert, not for a drained stream (counts.tolist() would)
        read = (self.count_reader(counts) if self.count_reader is not None else counts.tolist) if local else None
        out = self.shared(h) if self.shared is not None else torch.zeros_like(h)
        rows = h.index_select(0, tok)  # [T*k, C]
        # [T*k, C], row i = expert output for slot order[i]
        y = self.local_experts(rows, read()) if local else self.comm.routed(self, rows, counts)
        w = weight.reshape(-1).index_select(0, order)
        return out.index_add(0, tok, y * w[:, None])

    def local_experts(self, x: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        """Rows grouped by local expert (per_expert[j] rows for expert first_local + j) -> their outputs."""
        outs, off = [], 0
        for j, rows in enumerate(per_expert):
            if rows:
                outs.append(self.experts[str(self.first_local + j)](x[off:off + rows]))
                off += rows
        # no rows at all: keep the (empty) graph connected, so the backward still joins every all-to-all
        return torch.cat(outs) if outs else x * 0


class Sublayer(nn.Module):
    """F of one sub-layer: pre-norm then core. `norm` and `core` are separate so recompute can rebuild the norm
    output (Table 3's RMSNorm(H_pre x_l)) without re-running the core."""

    def __init__(self, hidden: int, core: nn.Module):
        super().__init__()
        self.norm = RMSNorm(hidden)
        self.core = core

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.core(self.norm(u))


class Block(nn.Module):
    """One Transformer block: attention sub-layer l = 2b, MLP/MoE sub-layer l = 2b + 1, both in mHC."""

    def __init__(self, model_cfg, seq_len: int, index: int, store: WeightGradStore | None, *, seed: int = 0,
                 comm=None):
        super().__init__()
        c, res = model_cfg.hidden, model_cfg.residual
        self.index = index
        attn = Sublayer(c, Attention(c, model_cfg.num_heads, model_cfg.head_dim, seq_len, store))
        moe = model_cfg.moe
        if moe is not None and index >= moe.first_dense_blocks:
            core: nn.Module = MoE(c, moe.num_experts, moe.top_k, moe.num_shared, moe.expert_hidden, store,
                                  seed=seed, tag=f"block{index}/moe", comm=comm, layer=2 * index + 1)
        else:
            core = SwiGLU(c, model_cfg.mlp_hidden, store)
        self.variant = res.variant
        self.attn = wrap_sublayer(res, attn, c, 2 * index, seq_len, mlp=False)
        self.mlp = wrap_sublayer(res, Sublayer(c, core), c, 2 * index + 1, seq_len, mlp=True)

    def sublayers(self) -> tuple[tuple[int, nn.Module], tuple[int, nn.Module]]:
        return ((2 * self.index, self.attn), (2 * self.index + 1, self.mlp))

    def forward(self, x: torch.Tensor, a: torch.Tensor | None = None):
        """Both sub-layers as one module call (the single-process path). mhc-sp carries the input-mixing
        coefficient a and returns (x, a); xHC-Flash hands the attention's routing to the MLP."""
        if rs.variant(self.variant).carries_coefficient:
            x, a = self.attn(x, a)
            return self.mlp(x, a)
        if rs.variant(self.variant).takes_k and self.attn.config.flash:
            routing = self.attn.coefficients(x)
            x = self.attn.apply_post_res(x, self.attn.sublayer(self.attn.apply_pre(x, routing)), routing)
            return self.mlp(x, routing=routing)
        return self.mlp(self.attn(x))


def wrap_sublayer(res, f: nn.Module, hidden: int, layer: int, seq_len: int, *, mlp: bool) -> nn.Module:
    """F in the configured residual, in the module its variant names (kernels.residual_spec: MHCSublayer for
    residual, hc, mhc, mhc-lite; single-pass mHC; xHC)."""
    kind = rs.variant(res.variant).layer
    if kind == "single_pass":
        return single_pass.SinglePassSublayer(res, f, hidden, layer_index=layer)
    if kind == "xhc":
        return XHCSublayer(res, f, hidden, layer_index=layer, seq_len=seq_len, mlp=mlp)
    return MHCSublayer(res, f, hidden, layer_index=layer)


class Embedding(nn.Module):
    """Token ids [T] -> x_0 [T, n, C] (embedding, then expand once per stack)."""

    def __init__(self, model_cfg, dtype: torch.dtype):
        super().__init__()
        self.tok = nn.Embedding(model_cfg.vocab_size, model_cfg.hidden)
        nn.init.normal_(self.tok.weight, std=0.02)
        self.expand = StreamExpand(model_cfg.residual, model_cfg.hidden)
        self.dtype = dtype
        # mhc-sp: the static input-mixing coefficient A_{-1} of the model's first sub-layer (logits, 0 = 0.5 each)
        self.entry = nn.Parameter(torch.zeros(model_cfg.residual.n)) \
            if rs.variant(model_cfg.residual.variant).carries_coefficient else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.expand(self.tok(ids).to(self.dtype))

    def entry_coefficient(self, tokens: int, like: torch.Tensor) -> torch.Tensor:
        """mhc-sp: A_{-1} for `tokens` tokens [T, n] (fp32, fp64 for fp64 activations)."""
        return single_pass.entry_coefficient(self.entry, tokens, like.dtype)


class Head(nn.Module):
    """x [T, n, C] -> contract (mean over streams) -> norm -> logits [T, V] -> summed cross-entropy / scale."""

    def __init__(self, model_cfg, store: WeightGradStore | None):
        super().__init__()
        self.norm = RMSNorm(model_cfg.hidden)
        self.out = DeferLinear(model_cfg.hidden, model_cfg.vocab_size, store)

    def logits(self, x: torch.Tensor, a: torch.Tensor | None = None) -> torch.Tensor:
        """a: mhc-sp's last carried coefficient, which folds the streams (V4.1) instead of the mean."""
        return self.out(self.norm(contract(x) if a is None else single_pass.contract(x, a)))

    def forward(self, x: torch.Tensor, labels: torch.Tensor, total_tokens: int,
                a: torch.Tensor | None = None) -> torch.Tensor:
        """Loss contribution of this micro-batch: sum of token losses / tokens of the whole step."""
        logits = self.logits(x, a)
        return F_.cross_entropy(logits.to(acc_dtype(logits)), labels, reduction="sum") / total_tokens


def activation_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[name]


def param_dtype(name: str) -> torch.dtype:
    """Parameters are fp32 (bf16 activations compute against fp32 masters), fp64 for fp64 runs."""
    return torch.float64 if name == "float64" else torch.float32


def build_embedding(model_cfg, seed: int, dtype: torch.dtype) -> Embedding:
    with seeded(seed, "embed"):
        return Embedding(model_cfg, dtype)


def build_block(model_cfg, seq_len: int, index: int, seed: int, store: WeightGradStore | None = None,
                comm=None) -> Block:
    """Block `index`; `comm` (pipeline.distributed.expert.ExpertComm) splits its MoE experts over an EP group."""
    with seeded(seed, f"block{index}"):
        return Block(model_cfg, seq_len, index, store, seed=seed, comm=comm)


def build_head(model_cfg, seed: int, store: WeightGradStore | None = None) -> Head:
    with seeded(seed, "head"):
        return Head(model_cfg, store)


def make_optimizer(params, train_cfg) -> torch.optim.AdamW:
    """AdamW as the runtime and the single-process reference both use it (elementwise: per-rank == global).
    CUDA: the fused kernel (one launch for all parameters instead of several per parameter); CPU: the plain
    per-parameter loop, whose arithmetic the equivalence tests compare bit for bit across layouts."""
    params = list(params)
    on_cuda = bool(params) and all(p.device.type == "cuda" for p in params)
    if on_cuda:
        return torch.optim.AdamW(params, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay, fused=True)
    return torch.optim.AdamW(params, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay, foreach=False)
