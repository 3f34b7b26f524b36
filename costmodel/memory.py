"""Memory per rank: model states, activations of the schedule's peak live micro-batches, mHC with and without
recompute (mHC Table 3), the recompute block size (Eq. 20 limited to the stage), P2P buffers.

* Model states, mixed-precision Adam: 16 bytes per parameter (bf16 weight and gradient, fp32 master weight and
  two moments; ZeRO arXiv 1910.02054 §3.1), no optimizer sharding (ZeRO-1 over data parallelism would divide the
  12 optimizer bytes; not modelled). DualPipe holds two stages per rank (both copies of a block): counted.
* Activations, counted per stored tensor (Korthikanti et al. arXiv 2205.05198's method), per token, with
  FlashAttention (no T x T matrix). Attention sub-layer: norm input C, normed C, q k v 3q, attention output q
  (+ fp32 log-sum-exp per head); SwiGLU: norm input C, normed C, gate and up 2H, activation H; MoE: norm input
  and normed 2C, router logits E (fp32), permuted token copies kC, per copy gate, up, activation 3He, the
  shared experts like a SwiGLU of hidden shared*He, the combine input kC. Embedding output C; head: normed C
  and fp32 logits V. One chunk = one stage's layers for one micro-batch.
* Residual side of a stage (mhc_cost.residual_activation_elems; what pipeline/stage.py keeps): without recompute
  x_l + F output + coefficients per sub-layer ((n+1)C + fp32 mix; nothing for the plain residual, whose x_l is
  its norm input); with recompute of blocks of L_r sub-layers x_l0 once per block (ceil(L / L_r) of them), F's
  output and the coefficients per sub-layer, minus F's norm input and output (2C), which the recompute rebuilds.
  The plain residual (the baseline) recomputes under the same config as the runtime does, with its own Eq. 20
  block (n = 1). Plus a transient while the active block's backward runs (mhc_cost.recompute_transient_elems:
  ((n+2)L_r - n)C, (2L_r - 1)C for the plain residual; Eq. 20's second term).
* Eq. 20:  L_r* = argmin_{1 <= L_r <= L} [ n C ceil(L / L_r) + (n+2) C L_r ],  L = sub-layers on the stage
  (recompute blocks never cross a stage boundary, mhc.md §5).
* Receive buffers: one forward and one backward boundary buffer (T n C, plus mhc-sp's carried coefficient) per
  stage held by the rank.
"""
from __future__ import annotations

from dataclasses import dataclass

from costmodel.mhc_cost import (ResidualSpec, mhc_params_per_sublayer, recompute_transient_elems,
                               residual_activation_elems)
from costmodel.ops import block_params
from configs import RunConfig, recompute_block_size

BYTES_PER_PARAM = 16


def recompute_block(cfg: RunConfig, spec: ResidualSpec, stage_sublayers: int) -> int | None:
    """The recompute block size for a stage with `stage_sublayers` sub-layers, or None (no recompute): the rule
    the runtime applies (pipeline/train.py), the plain residual included (n = 1). A configured block longer than
    the stage is one block of the whole stage, so it is counted as the stage's length."""
    size = recompute_block_size(cfg.recompute, stage_sublayers, spec.n)
    return None if size is None else max(1, min(size, stage_sublayers))


def sublayer_activation_elems(cfg: RunConfig, block: int, d: int) -> tuple[float, float]:
    """(attention, MLP) activation elements per token a block keeps for backward (baseline residual)."""
    m = cfg.model
    C, q = m.hidden, m.num_heads * m.head_dim
    fp32 = 4 / d
    attn = 2 * C + 4 * q + fp32 * m.num_heads
    if m.moe is None or block < m.moe.first_dense_blocks:
        mlp = 2 * C + 3 * m.mlp_hidden
    else:
        e = m.moe
        mlp = (2 * C + fp32 * e.num_experts + 2 * e.top_k * C + 3 * e.top_k * e.expert_hidden
               + 3 * e.num_shared * e.expert_hidden)
    return attn, mlp


@dataclass
class StageMemory:
    stage: int
    blocks: int
    params: float
    chunk_activation_bytes: float
    recompute_block: int | None
    transient_bytes: float


@dataclass
class RankMemory:
    rank: int
    model_state_bytes: float
    activation_bytes: float
    transient_bytes: float
    buffer_bytes: float
    peak_live_chunks: int

    @property
    def total_bytes(self) -> float:
        return self.model_state_bytes + self.activation_bytes + self.transient_bytes + self.buffer_bytes


def stage_memory(cfg: RunConfig, spec: ResidualSpec, stage: int, blocks: range, first: bool, last: bool,
                 recompute: bool = True) -> StageMemory:
    m, p = cfg.model, cfg.parallel
    from costmodel.ops import DTYPE_BYTES

    d = DTYPE_BYTES[cfg.train.dtype]
    T, C = p.tokens_per_microbatch, m.hidden
    L = 2 * len(blocks)
    L_r = recompute_block(cfg, spec, L) if recompute else None
    elems = residual_activation_elems(spec, C, d, L, L_r)
    params = 0.0
    for b in blocks:
        a, f = sublayer_activation_elems(cfg, b, d)
        elems += a + f
        params += block_params(cfg, b, p.expert_parallel) + 2 * mhc_params_per_sublayer(spec, C)
    if first:  # the embedding output; the expanded x_0 is the first sub-layer's x_l, counted on the residual side
        elems += C
        params += m.vocab_size * C
    if last:
        elems += C + 4 / d * m.vocab_size
        params += m.vocab_size * C + C
    transient = recompute_transient_elems(spec, C, L_r) * T * d if L_r else 0.0
    return StageMemory(stage, len(blocks), params, elems * T * d, L_r, transient)


def rank_memory(cfg: RunConfig, spec: ResidualSpec, stages: dict[int, StageMemory], stages_of_rank: list[int],
                rank: int, peak_live: int) -> RankMemory:
    mine = [stages[s] for s in stages_of_rank]
    from costmodel.ops import DTYPE_BYTES

    d = DTYPE_BYTES[cfg.train.dtype]
    T, C = cfg.parallel.tokens_per_microbatch, cfg.model.hidden
    return RankMemory(
        rank=rank,
        model_state_bytes=BYTES_PER_PARAM * sum(s.params for s in mine),
        activation_bytes=peak_live * max(s.chunk_activation_bytes for s in mine),
        transient_bytes=max(s.transient_bytes for s in mine),
        buffer_bytes=2 * len(mine) * T * (spec.width * C * d + spec.carry_bytes),
        peak_live_chunks=peak_live)
