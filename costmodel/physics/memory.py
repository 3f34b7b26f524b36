"""Memory per rank: model states, activations of the live micro-batches at the schedule's peak, mHC with and without
recompute (mHC Table 3), the recompute block size (Eq. 20 limited to the stage), P2P buffers.

* Model states, Adam as Megatron-LM counts them (bytes per parameter, d = the data-parallel ranks that share
  the parameter's optimizer state; Megatron Core docs, "Distributed Optimizer" table, and
  megatron/training/theoretical_memory_usage.py, compute_weight_and_optimizer_memory):
  train.dtype bfloat16: bf16 weight 2 + fp32 main gradient 4, kept on every rank (6), + fp32 master weight 4 and
  Adam m, v 8 (12): 18 without the distributed optimizer, 6 + 12/d with it (train.distributed_optimizer:
  ZeRO-1, arXiv 1910.02054 §5.1, which shards the optimizer state, not the gradients or weights);
  float32 (Megatron's fp32 row): weight 4 + gradient 4 (8) + m, v 8: 16, or 8 + 8/d; float64: the fp32 row
  doubled (derived): 32, or 16 + 16/d. Which d divides what (Megatron's expert-data-parallel group, the
  runtime's gradient groups, data_parallel.py): dense parameters (attention, norms, router, shared experts,
  embedding, head, mHC coefficients) d = D, the data-parallel replicas; routed experts, already split over
  EP, d = D / EP, the replicas holding the same experts (max(1, D // EP): a config with D < EP prices one
  replica's EP ranks as if they held the experts alone). Megatron's own formula uses one d for all (it also
  ignores EP); with EP = 1 the two agree. DualPipe holds two stages per rank (both copies of a block): counted.
* Reserve per GPU (rank_memory's `hw` a GPU spec; nothing on a CPU spec, whose ranks have no CUDA context),
  RankMemory.reserve_bytes, stated assumptions, not measured here: CUDA context CUDA_CONTEXT_BYTES = 0.75 GiB
  (a PyTorch process's first CUDA call takes ~0.7 GiB, 723 MiB in discuss.pytorch.org/t/73021; 0.5-1 GiB is
  the range commonly seen, lazy module loading, CUDA >= 12.2's default, at the low end); NCCL
  NCCL_BUFFER_BYTES = 0.5 GiB for all of a rank's communicators (DP and expert-DP all-reduce, PP P2P: NCCL's
  default NCCL_BUFFSIZE is 4 MiB per channel and peer, ~32 channels x send/receive x the protocols is a few
  hundred MiB per communicator; our assumption); DeepEP, when EP > 1: DEEPEP_NVL_BYTES = 2e9 of NVLink buffer,
  plus DEEPEP_RDMA_BYTES = 1e9 of RDMA buffer when the EP group spans nodes (the sizes DeepEP V1's own tests
  allocate for its training/prefill kernels, tests/test_intranode.py and test_internode.py:
  `Buffer(group, int(2e9), int(1e9))`; DeepEP V2's README: its buffers are larger than V1's); allocator
  fragmentation FRAGMENTATION = 5% of the dynamically allocated bytes (activations, the recompute transient,
  receive buffers; model states live in contiguous buffers allocated once): Megatron's theoretical memory adds
  the same 5% to activations for "optimizer and miscellaneous temporaries".
* Activations, counted per stored tensor (Korthikanti et al. arXiv 2205.05198's method), per token, with
  FlashAttention (no T x T matrix). Attention sub-layer: norm input C, normed C, q k v 3q, attention output q
  (+ fp32 log-sum-exp per head); SwiGLU: norm input C, normed C, gate and up 2H, activation H; MoE: norm input
  and normed 2C, router logits E (fp32), permuted token copies kC, per copy gate, up, activation 3He, the
  shared experts like a SwiGLU of hidden shared*He, the combine input kC. Embedding output C; head: normed C
  and fp32 logits V. One chunk = one stage's layers for one micro-batch. MLA (model.mla) keeps its latents, not
  the heads (DeepSeek-V3 §3.3.3 recomputes the up-projections): norm input and normed C each, the query latent
  and its norm 2 q_lora, the key/value latent with the rotary key and its norm 2 kv_lora + rope, the attention
  output h v and the fp32 log-sum-exp per head. FP8 storage (train.fp8_storage, default train.fp8) is
  DeepSeek-V3's recipe (§3.2.3, §3.3.3): the SwiGLU inputs (gate and up) and the routed experts' received tokens
  are cached in FP8 (1 byte + a scale per 128) and the SwiGLU output is recomputed in backward; every RMSNorm is
  recomputed (its input kept, not its output); the router probabilities weight the experts' SwiGLU output before the
  down projection (Megatron-LM's weighted SwiGLU with DeepEP), so the combine keeps no k C copy of the expert outputs.
  MTP (model.mtp_depth) on the last stage: per module the projection's input and output 3C, one MoE block with
  its residual side (no recompute) and the head's normed C and fp32 logits.
* The activation peak follows the schedule (`activation_peak`): walking a rank's program, a chunk is alive from
  the start of its F to the end of its B (or I), each weighing its own stage's bytes (the head's fp32 logits only
  on the stage that holds the head); the peak is the largest sum, and the live chunks per stage at that moment
  are reported. (Live count x the largest chunk over-counts a rank holding a light and a heavy stage: DualPipe
  rank 0 holds up to 2P micro-batches of stage 0 but one or two of stage 2P-1, the one with the head.)
* Residual side of a stage (mhc_cost.residual_activation_elems; what pipeline/runtime/stage.py keeps): without recompute
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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import math

from costmodel.physics.comm_cost import ep_ranks_per_node
from costmodel.physics.hardware import HardwareSpec, MemoryReserve
from costmodel.physics.mhc_cost import (ResidualSpec, mhc_params_per_sublayer, recompute_transient_elems,
                               residual_activation_elems)
from costmodel.physics.ops import DTYPE_BYTES, FP8_SCALE_BYTES, block_params, mtp_params
from configs import RunConfig, recompute_block_size

if TYPE_CHECKING:  # annotations only: numpy is imported where the tuner's ProgramEvents are made
    import numpy as np

GIB = 2 ** 30
# model-state bytes per parameter by train.dtype: (kept on every rank: weight + main gradient, sharded by the
# distributed optimizer: master weight + Adam m, v); Megatron's table, see the module docstring
STATE_BYTES = {"bfloat16": (6.0, 12.0), "float32": (8.0, 8.0), "float64": (16.0, 16.0)}
# the reserve's default terms (the spec's `reserve` holds the values a prediction uses; --sensitivity moves them)
_DEFAULT = MemoryReserve()
CUDA_CONTEXT_BYTES = _DEFAULT.cuda_context_bytes
NCCL_BUFFER_BYTES = _DEFAULT.nccl_bytes
DEEPEP_NVL_BYTES = _DEFAULT.deepep_nvl_bytes
DEEPEP_RDMA_BYTES = _DEFAULT.deepep_rdma_bytes
FRAGMENTATION = _DEFAULT.fragmentation


def state_bytes_per_param(dtype: str, distributed_optimizer: bool, d: int) -> float:
    """Model-state bytes per parameter whose optimizer state `d` data-parallel ranks share (module docstring):
    18 for bf16 without the distributed optimizer, 6 + 12/d with it."""
    kept, sharded = STATE_BYTES[dtype]
    return kept + sharded / (max(1, d) if distributed_optimizer else 1)


def is_gpu(hw: HardwareSpec | None) -> bool:
    """A GPU spec (the reserve applies): not `local`, whose ranks share a host's CPU cores."""
    return hw is not None and hw.host_cores is None and hw.runtime is None


def fixed_reserve_bytes(cfg: RunConfig, hw: HardwareSpec | None, ep_per_node: int | None = None) -> float:
    """The reserve's fixed part per GPU: CUDA context, NCCL buffers, DeepEP buffers (EP > 1; RDMA when the EP
    group spans nodes, comm.ep_ranks_per_node with pricing_options.Options.ep_per_node). 0 on a CPU spec."""
    if not is_gpu(hw):
        return 0.0
    ep = cfg.parallel.expert_parallel
    r = hw.reserve
    out = r.cuda_context_bytes + r.nccl_bytes
    if ep > 1:
        out += r.deepep_nvl_bytes + (r.deepep_rdma_bytes if ep_ranks_per_node(hw, ep, ep_per_node) < ep else 0.0)
    return out


def recompute_block(cfg: RunConfig, spec: ResidualSpec, stage_sublayers: int) -> int | None:
    """The recompute block size for a stage with `stage_sublayers` sub-layers, or None (no recompute): the rule
    the runtime applies (pipeline/runtime/train.py), the plain residual included (n = 1). A configured block longer than
    the stage is one block of the whole stage, so it is counted as the stage's length."""
    size = recompute_block_size(cfg.recompute, stage_sublayers, spec.n)
    return None if size is None else max(1, min(size, stage_sublayers))


def sublayer_activation_elems(cfg: RunConfig, block: int, d: int) -> tuple[float, float]:
    """(attention, MLP) activation elements per token a block keeps for backward (baseline residual), in units of
    d bytes (an FP8 element counts (1 + scale) / d)."""
    m = cfg.model
    C, q, h = m.hidden, m.num_heads * m.head_dim, m.num_heads
    fp32 = 4 / d
    a = m.mla
    v3 = cfg.train.fp8_activation_storage  # the V3 storage recipe (module docstring)
    norm = 1 if v3 else 2  # an RMSNorm keeps its input and output, or only its input when it is recomputed
    if a is None:
        attn = norm * C + 4 * q + fp32 * h
    else:
        attn = (norm * C + norm * a.q_lora_rank + norm * a.kv_lora_rank + a.qk_rope_head_dim + h * a.v_head_dim
                + fp32 * h)
    # a SwiGLU of hidden H keeps gate and up (2H) and its output H; in V3's recipe gate and up in FP8, the output
    # recomputed
    f8 = (1 + FP8_SCALE_BYTES) / d

    def swiglu(H: float) -> float:
        return 2 * H * f8 if v3 else 3 * H

    if m.moe is None or block < m.moe.first_dense_blocks:
        mlp = norm * C + swiglu(m.mlp_hidden)
    else:
        e = m.moe
        received = e.top_k * C * (f8 if v3 else 1)
        combine = 0 if v3 else e.top_k * C
        mlp = (norm * C + fp32 * e.num_experts + received + combine + swiglu(e.top_k * e.expert_hidden)
               + swiglu(e.num_shared * e.expert_hidden))
    return attn, mlp


@dataclass
class StageMemory:
    stage: int
    blocks: int
    params: float
    chunk_activation_bytes: float
    recompute_block: int | None
    transient_bytes: float
    expert_params: float = 0.0  # the routed-expert part of `params` (already split over EP)


@dataclass
class RankMemory:
    rank: int
    model_state_bytes: float
    activation_bytes: float
    transient_bytes: float
    buffer_bytes: float
    peak_live_chunks: int
    reserve_bytes: float = 0.0  # CUDA context, NCCL and DeepEP buffers, fragmentation (module docstring)
    live_chunks: dict[int, int] = field(default_factory=dict)  # stage -> chunks alive at the activation peak

    @property
    def total_bytes(self) -> float:
        return (self.model_state_bytes + self.activation_bytes + self.transient_bytes + self.buffer_bytes
                + self.reserve_bytes)


def stage_memory(cfg: RunConfig, spec: ResidualSpec, stage: int, blocks: range, first: bool, last: bool,
                 recompute: bool = True) -> StageMemory:
    m, p = cfg.model, cfg.parallel
    from costmodel.physics.ops import DTYPE_BYTES

    d = DTYPE_BYTES[cfg.train.dtype]
    T, C = p.tokens_per_microbatch, m.hidden
    L = 2 * len(blocks)
    L_r = recompute_block(cfg, spec, L) if recompute else None
    elems = residual_activation_elems(spec, C, d, L, L_r)
    params = experts = 0.0
    per_kind: dict[bool, tuple[float, float, float]] = {}  # a block's terms depend only on whether it is dense
    for b in blocks:
        dense = m.moe is None or b < m.moe.first_dense_blocks
        terms = per_kind.get(dense)
        if terms is None:
            a, f = sublayer_activation_elems(cfg, b, d)
            own = block_params(cfg, b, p.expert_parallel)
            terms = per_kind[dense] = (a + f, own + 2 * mhc_params_per_sublayer(spec, C),
                                       own - block_params(cfg, b, math.inf))
        elems += terms[0]
        params += terms[1]
        experts += terms[2]
    if first:  # the embedding output; the expanded x_0 is the first sub-layer's x_l, counted on the residual side
        elems += C
        params += m.vocab_size * C
    if last:
        elems += C + 4 / d * m.vocab_size
        params += m.vocab_size * C + C
    if last and m.mtp_depth:  # MTP modules (module docstring): projection, one MoE block, the shared head again
        a, f = sublayer_activation_elems(cfg, m.num_blocks, d)
        elems += m.mtp_depth * (3 * C + a + f + residual_activation_elems(spec, C, d, 2, None)
                                + C + 4 / d * m.vocab_size)
        params += mtp_params(cfg, p.expert_parallel) + 2 * m.mtp_depth * mhc_params_per_sublayer(spec, C)
        experts += mtp_params(cfg, p.expert_parallel) - mtp_params(cfg, math.inf)
    transient = recompute_transient_elems(spec, C, L_r) * T * d if L_r else 0.0
    return StageMemory(stage, len(blocks), params, elems * T * d, L_r, transient, experts)


def model_state_bytes(cfg: RunConfig, stages: list[StageMemory], dp: int | None = None) -> float:
    """Model states of the stages one rank holds: dense parameters at d = D, routed experts at d = D / EP
    (module docstring). `dp`: the data-parallel replicas D (default cfg.parallel.data_parallel; the tuner
    prices one replica's config and passes its layout's D)."""
    D = cfg.parallel.data_parallel if dp is None else dp
    dist, dtype = cfg.train.distributed_optimizer, cfg.train.dtype
    dense = sum(s.params - s.expert_params for s in stages)
    experts = sum(s.expert_params for s in stages)
    return (state_bytes_per_param(dtype, dist, D) * dense
            + state_bytes_per_param(dtype, dist, max(1, D // cfg.parallel.expert_parallel)) * experts)


@dataclass(frozen=True)
class ProgramEvents:
    """One rank's program as chunk events, in order: the stage a chunk belongs to and +1 (its forward starts: the
    chunk is alive) or -1 (its backward ends: freed). An overlapped F&B is +1 of its forward's stage, then -1 of its
    backward's. Built once per program (`program_events`), priced for any stage bytes (`activation_peak`): the
    tuner prices thousands of candidates on a few programs."""

    stage: np.ndarray  # int64
    sign: np.ndarray  # float64, +1 / -1


def _events(actions) -> tuple[list[int], list[float]]:
    """The program's chunk events (ProgramEvents) as two lists."""
    from schedules.ir import Kind

    KF, KFB, KB, KI = Kind.F, Kind.FB, Kind.B, Kind.I
    stage: list[int] = []
    sign: list[float] = []
    put, sgn = stage.append, sign.append
    for a in actions:  # by position (Action's fields: kind, stage, mb, b_stage): the tuner walks ~10^6 actions
        k = a[0]
        if k is KF:
            put(a[1])
            sgn(1.0)
        elif k is KFB:  # its forward's chunk alive before its backward's is freed
            put(a[1])
            sgn(1.0)
            put(a[3])
            sgn(-1.0)
        elif k is KB or k is KI:
            put(a[1])
            sgn(-1.0)
    return stage, sign


def program_events(actions) -> ProgramEvents:
    import numpy as np  # here, not at the top: `mhcpipe predict` walks its few programs without numpy (~0.05 s)

    stage, sign = _events(actions)
    return ProgramEvents(np.asarray(stage, dtype=np.int64), np.asarray(sign, dtype=np.float64))


def activation_peak(actions, stages: dict[int, StageMemory]) -> tuple[float, dict[int, int]]:
    """The largest sum of live chunks' activation bytes over one rank's program (`actions`, schedules.ir.Action,
    or its ProgramEvents), each chunk weighing its own stage's bytes, and the live chunks per stage at that peak
    (module docstring; the first peak when several are equal). An overlapped F&B holds its forward's chunk before
    it frees its backward's. ProgramEvents (the tuner's thousands of layouts) are summed by numpy's cumsum, which
    adds in program order as the walk over actions does: the two give the same floats."""
    if not isinstance(actions, ProgramEvents):
        return _walked_peak(*_events(actions), stages)
    import numpy as np

    ev = actions
    if ev.stage.size == 0:
        return 0.0, {}
    keys = sorted(stages)
    weight = np.zeros(max(keys) + 1)
    for s in keys:
        weight[s] = stages[s].chunk_activation_bytes
    total = np.cumsum(weight[ev.stage] * ev.sign)
    i = int(np.argmax(total))
    peak = float(total[i])
    if peak <= 0.0:
        return 0.0, {}
    live = np.rint(np.bincount(ev.stage[: i + 1], weights=ev.sign[: i + 1])).astype(np.int64)
    alive = np.flatnonzero(live > 0)
    return peak, dict(zip(alive.tolist(), live[alive].tolist()))


def _walked_peak(stage: list[int], sign: list[float], stages: dict[int, StageMemory]) -> tuple[float, dict[int, int]]:
    """activation_peak by a walk over the events: the running sum in program order, the first largest."""
    if not stage:
        return 0.0, {}
    weight = {s: m.chunk_activation_bytes for s, m in stages.items()}
    total, peak, at = 0.0, -math.inf, -1
    for i, (s, g) in enumerate(zip(stage, sign)):
        total += weight.get(s, 0.0) * g
        if total > peak:
            peak, at = total, i
    if peak <= 0.0:
        return 0.0, {}
    live: dict[int, float] = {}
    for s, g in zip(stage[: at + 1], sign[: at + 1]):
        live[s] = live.get(s, 0.0) + g
    return peak, {s: round(v) for s, v in sorted(live.items()) if round(v) > 0}


def rank_memory(cfg: RunConfig, spec: ResidualSpec, stages: dict[int, StageMemory], stages_of_rank: list[int],
                rank: int, actions, *, hw: HardwareSpec | None = None, dp: int | None = None,
                ep_per_node: int | None = None, peak: tuple[float, dict[int, int]] | None = None) -> RankMemory:
    """Peak memory of one rank whose program is `actions` (its compute actions in issue order). `hw`: a GPU spec
    adds the reserve (none without it, or on a CPU spec); `dp`: the data-parallel replicas that share the
    optimizer state (default the config's); `ep_per_node`: pricing_options.Options.ep_per_node (whether DeepEP needs its
    RDMA buffer); `peak`: activation_peak(actions, stages) when the caller has it (tune: one per program and
    stage weights, shared by every layout that differs only in what does not weigh a chunk)."""
    return rank_memories(cfg, spec, stages, {rank: stages_of_rank}, {rank: actions}, hw=hw, dp=dp,
                         ep_per_node=ep_per_node, peaks=None if peak is None else {rank: peak})[0]


def rank_memories(cfg: RunConfig, spec: ResidualSpec, stages: dict[int, StageMemory],
                  stages_of_rank: dict[int, list[int]], programs: dict, *, hw: HardwareSpec | None = None,
                  dp: int | None = None, ep_per_node: int | None = None,
                  peaks: dict | None = None) -> list[RankMemory]:
    """rank_memory of each rank in `stages_of_rank` (rank -> its stages; `programs`, `peaks`: rank -> its
    actions or ProgramEvents, its activation peak when known), in that order. What does not depend on the rank is
    computed once: the tuner prices ~10^5 ranks a search."""
    d = DTYPE_BYTES[cfg.train.dtype]
    T, C = cfg.parallel.tokens_per_microbatch, cfg.model.hidden
    per_token = spec.width * C * d + spec.carry_bytes
    fixed = fixed_reserve_bytes(cfg, hw, ep_per_node)
    frag = hw.reserve.fragmentation if is_gpu(hw) else None
    out = []
    for rank, mine_ids in stages_of_rank.items():
        mine = [stages[s] for s in mine_ids]
        act, live = activation_peak(programs[rank], stages) if peaks is None else peaks[rank]
        transient = max(s.transient_bytes for s in mine)
        buffers = 2 * len(mine) * T * per_token
        reserve = fixed
        if frag is not None:
            reserve += frag * (act + transient + buffers)
        out.append(RankMemory(rank=rank, model_state_bytes=model_state_bytes(cfg, mine, dp), activation_bytes=act,
                              transient_bytes=transient, buffer_bytes=buffers, peak_live_chunks=sum(live.values()),
                              reserve_bytes=reserve, live_chunks=live))
    return out
