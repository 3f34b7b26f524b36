"""Run configuration: model, parallel layout, recompute and training settings (pydantic, YAML in configs/).

Shape letters: T tokens per micro-batch (micro-batch size x sequence length), n residual streams, C hidden,
L_b Transformer blocks, P pipeline ranks, M micro-batches. Invalid values fail at load time with the field's
name and the fix. The same `RunConfig` drives the runtime (`pipeline`) and the cost model (`costmodel`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kernels.config import MHCConfig

CONFIG_DIR = Path(__file__).resolve().parent  # the YAML presets sit next to the models
# a registered schedule kind (schedules.registry: the one list of names); checked where the config is validated
ScheduleKind = str


class MoEConfig(BaseModel):
    """Mixture of experts in the MLP sub-layer (DeepSeek style: routed top-k plus always-on shared experts)."""

    model_config = ConfigDict(extra="forbid")
    num_experts: int = Field(ge=1, description="routed experts")
    top_k: int = Field(ge=1, description="routed experts active per token")
    num_shared: int = Field(0, ge=0, description="shared experts every token uses")
    expert_hidden: int = Field(ge=1, description="FFN hidden size of one expert")
    first_dense_blocks: int = Field(0, ge=0, description="leading blocks with a dense MLP instead of MoE")
    max_nodes_per_token: int | None = Field(
        None, ge=1, description="node-limited routing (DeepSeek-V3 §2.1.2): a token's top_k experts lie on at most "
        "this many nodes, so its dispatch crosses the network to at most this many (cost model; None = no limit)")

    @model_validator(mode="after")
    def _top_k(self) -> "MoEConfig":
        if self.top_k > self.num_experts:
            raise ValueError(f"moe.top_k={self.top_k} exceeds moe.num_experts={self.num_experts}")
        return self


class MLAConfig(BaseModel):
    """Multi-head latent attention (DeepSeek-V2/V3): queries and keys/values pass through low-rank latents; a head's
    query/key is a no-position part plus a rotary part (model.head_dim = qk_nope_head_dim + qk_rope_head_dim), its
    value v_head_dim wide. Priced by the cost model (costmodel/physics/ops.py); the runtime's attention is
    multi-head."""

    model_config = ConfigDict(extra="forbid")
    q_lora_rank: int = Field(ge=1, description="query latent width (V3: 1536)")
    kv_lora_rank: int = Field(ge=1, description="key/value latent width (V3: 512)")
    qk_rope_head_dim: int = Field(ge=1, description="rotary part of a query/key head, the key's shared by all heads "
                                  "(V3: 64)")
    qk_nope_head_dim: int = Field(ge=1, description="no-position part of a query/key head (V3: 128)")
    v_head_dim: int = Field(ge=1, description="value head width (V3: 128)")


class ModelConfig(BaseModel):
    """A decoder-only Transformer whose sub-layers (attention, MLP/MoE) sit in the chosen residual variant."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field("custom", description="preset name, for reports")
    vocab_size: int = Field(ge=2, description="vocabulary size")
    num_blocks: int = Field(ge=1, description="Transformer blocks L_b (each = attention + MLP sub-layer)")
    hidden: int = Field(ge=1, description="hidden size C of one residual stream")
    num_heads: int = Field(ge=1, description="attention heads")
    head_dim: int = Field(ge=1, description="dimension per head (q/k/v width = num_heads x head_dim)")
    mlp_hidden: int = Field(ge=1, description="SwiGLU hidden size of a dense MLP")
    moe: MoEConfig | None = Field(None, description="MoE settings; None = dense MLP in every block")
    residual: MHCConfig = Field(default_factory=lambda: MHCConfig(variant="mhc", n=4),
                                description="residual variant and its settings (kernels.MHCConfig)")
    mla: MLAConfig | None = Field(None, description="multi-head latent attention; None = multi-head attention of "
                                  "num_heads x head_dim (cost model only)")
    mtp_depth: int = Field(0, ge=0, description="multi-token prediction modules after the last block (DeepSeek-V3 "
                           "§2.2: each a projection, one more block and the shared head; cost model only)")

    @model_validator(mode="after")
    def _mla(self) -> "ModelConfig":
        a = self.mla
        if a is None:
            return self
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        if self.head_dim != qk:
            raise ValueError(f"model.head_dim={self.head_dim} must equal mla.qk_nope_head_dim + mla.qk_rope_head_dim "
                             f"= {qk}: an MLA query/key head is its no-position part plus its rotary part")
        kv = self.num_heads * (a.qk_nope_head_dim + a.v_head_dim)
        for name, rank, full in (("q_lora_rank", a.q_lora_rank, self.num_heads * qk),
                                 ("kv_lora_rank", a.kv_lora_rank, kv)):
            if rank >= full:
                raise ValueError(f"model.mla.{name}={rank} is not below the {full} it compresses (model.num_heads="
                                 f"{self.num_heads} heads); a latent rank must be smaller, e.g. V3's 1536 / 512 "
                                 "for 128 heads")
        return self

    @property
    def num_sublayers(self) -> int:
        return 2 * self.num_blocks


class ParallelConfig(BaseModel):
    """Pipeline layout and batch shape."""

    model_config = ConfigDict(extra="forbid")
    schedule: ScheduleKind = Field("dualpipev", description="pipeline schedule")
    ranks: int = Field(ge=1, description="pipeline ranks P (--pp)")
    data_parallel: int = Field(1, ge=1, description="data-parallel replicas of the pipeline (--dp); the world is "
                               "ranks x data_parallel processes")
    microbatches: int = Field(ge=1, description="micro-batches M of one step's global batch; each of the "
                              "data_parallel pipelines runs M / data_parallel of them")
    microbatch_size: int = Field(1, ge=1, description="sequences per micro-batch")
    seq_len: int = Field(ge=1, description="tokens per sequence")
    expert_parallel: int = Field(1, ge=1, description="expert-parallel degree EP (--ep): the MoE experts of a stage "
                                 "are split over EP data-parallel ranks that exchange tokens by all-to-all; 1 = none. "
                                 "The runtime needs EP to divide data_parallel")
    overlap: bool = Field(True, description="run each F&B pair overlapped: the forward of one micro-batch "
                          "interleaved with the backward of another, each one's communication under the other's "
                          "compute (pipeline.runtime.overlap); false = forward then backward (--no-overlap, for A/B)")
    p2p_groups: Literal["channel", "shared"] = Field(
        "channel", description="process groups of the pipeline's P2P: 'channel' = one per direction of each "
        "pipeline link (deadlock-free under NCCL's rules, docs/communication.md); 'shared' = one group for all of a "
        "pipeline's P2P, the pre-0.9 design that deadlocks under NCCL (kept to reproduce it: --p2p-groups)")
    uneven_stages: bool = Field(False, description="the layout may give stages different block counts (the first "
                                "num_blocks % stages stages take one more, as the runtime splits them); false: "
                                "the cost model rejects a layout whose stage count does not divide the blocks")
    stage_split: list[int] | None = Field(None, description="blocks of each stage of a pipeline, in pipeline order "
                                          "(DualPipe: of each model chunk; as many entries as parallel.num_stages, "
                                          "summing to model.num_blocks), e.g. what `mhcpipe predict --split "
                                          "balanced` prints; the runtime and the cost model cut the model so. None: "
                                          "as even as possible")

    @property
    def tokens_per_microbatch(self) -> int:
        return self.microbatch_size * self.seq_len

    @property
    def microbatches_per_replica(self) -> int:
        """Micro-batches one pipeline (one data-parallel replica) runs per step: M / data_parallel."""
        return self.microbatches // self.data_parallel

    @property
    def world_size(self) -> int:
        return self.ranks * self.data_parallel

    @model_validator(mode="after")
    def _kind(self) -> "ParallelConfig":
        from schedules.registry import canonical, kind_of

        try:
            kind_of(self.schedule)
        except ValueError:
            from schedules.registry import names

            raise ValueError(f"schedule {self.schedule!r} is not a schedule kind; use one of {', '.join(names())}") \
                from None
        self.schedule = canonical(self.schedule)
        return self

    @property
    def num_stages(self) -> int:
        """Stages of one pipeline (schedules.registry: 2P for DualPipeV's V, P otherwise, DualPipe per direction)."""
        from schedules.registry import kind_of

        return kind_of(self.schedule).num_stages(self.ranks)


class RecomputeConfig(BaseModel):
    """mHC recompute (mHC §4.3.2): discard mHC intermediates after F, rebuild them in backward per block."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["off", "block", "auto"] = Field(
        "off", description="'off'; 'block' with block_size sub-layers; 'auto' = Eq. 20 limited to the stage")
    block_size: int | None = Field(None, ge=1, description="sub-layers per recompute block (mode 'block')")

    @model_validator(mode="after")
    def _block(self) -> "RecomputeConfig":
        if self.mode == "block" and self.block_size is None:
            raise ValueError("recompute.block_size is required when recompute.mode is 'block'")
        return self


class TrainConfig(BaseModel):
    """Training loop settings."""

    model_config = ConfigDict(extra="forbid")
    steps: int = Field(3, ge=1, description="optimizer steps")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    seed: int = Field(0, description="seed for parameters and synthetic data")
    data: str = Field("synthetic", description="'synthetic' (seeded random tokens) or a path to a token file")
    dtype: Literal["float32", "bfloat16", "float64"] = Field(
        "float32", description="activation dtype; parameters are fp32, or fp64 with 'float64' (CPU equivalence "
        "tests: sums in another order then differ by ~1e-16 instead of ~1e-7)")
    distributed_optimizer: bool = Field(
        False, description="Adam's fp32 master weights and moments sharded over the data-parallel ranks (ZeRO-1, "
        "Megatron-LM's --use-distributed-optimizer; routed experts over the D / EP replicas holding them): the cost "
        "model prices 6 + 12/D bytes per bf16 parameter instead of 18 (costmodel/physics/memory.py). The "
        "runtime's AdamW "
        "(pipeline.model.make_optimizer) keeps the whole state on every rank whatever this says")
    fp8: bool = Field(False, description="the linear layers' GEMMs in FP8 with fine-grained scaling and the MoE "
                      "dispatch in FP8 (DeepSeek-V3 §3.3: 1x128 activation tiles, 128x128 weight blocks, master "
                      "weights and optimizer states in higher precision); cost model only, on hardware with an "
                      "fp8 rate")
    fp8_storage: bool | None = Field(None, description="DeepSeek-V3's activation-storage recipe (§3.2.3, §3.3.3: "
                                     "SwiGLU inputs and routed tokens cached in FP8, norms and SwiGLU outputs "
                                     "recomputed), separately from the FP8 GEMMs; None = the same as fp8; cost "
                                     "model only")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="'auto' = cuda when available")
    emulate_cuda: bool = Field(False, description="run the runtime's CUDA path on CPU tensors under the emulated "
                               "CUDA device (pipeline.device.emulated): streams, events, stream-ordered waits and "
                               "host reads as on a GPU, and each rank's program written into --trace-dir for "
                               "`mhcpipe check-comm --cuda` (docs/cuda_program.md); --emulate-cuda")
    timeout_s: float = Field(60.0, gt=0, description="every P2P wait and collective gives up after this")
    first_step_timeout_s: float = Field(
        600.0, gt=0, description="GPU runs: the first step's deadline instead of timeout_s (when larger), since every "
        "rank JIT-compiles its Triton kernels and NCCL makes the connections the warm-up does not in it; "
        "NCCL's watchdog (pipeline.distributed.p2p.process_group_timeout_s) comes after both")
    comm_rules: Literal["backend", "nccl", "nccl-pair"] = Field(
        "backend", description="'backend' = the backend's own semantics; 'nccl' = gloo P2P run under NCCL's rules "
        "(per communicator one batch at a time in posting order, a send completes only while its receive runs; "
        "collectives compared across members every step), one queue per process group; 'nccl-pair' = the same "
        "with one queue per (group, peer). CPU only (pipeline.distributed.strict_transport); the one switch: "
        "--comm-rules and $MHCPIPE_COMM_RULES take the same values")
    trace_format: Literal["json", "npz"] = Field("json", description="what --trace-dir holds: our JSON (rank<r>.json, "
                                                  "trace.json) or our binary columns (rank<r>.npz, trace.npz: "
                                                  "docs/traces.md §8), for long runs; --trace-format")
    cpu_bind: bool = Field(False, description="CPU runs: bind local rank i to core i mod cores (consecutive ranks, "
                           "e.g. expert-parallel peers, on different cores; pipeline.runtime.cpu_binding), --cpu-bind")
    gc_interval: int = Field(1, ge=0, description="Python garbage collection: automatic collection is off while "
                             "training and a collection runs between steps every gc_interval steps, outside the "
                             "step's timing (torchtitan's gc_freq, Megatron's --manual-gc); 0 = leave Python's "
                             "automatic collection on, which stalls a rank for ~0.2 s at unpredictable actions")
    diagnostics_every: int = Field(0, ge=0, description="stream-collapse diagnostics (per-stream norms, read/write "
                                   "shares, H_res distance from identity, composite gains per layer) on step 0, "
                                   "every k-th step and the last, written as diagnostics_rank<r>.json next to the "
                                   "trace (needs --trace-dir); 0 = off. --diagnostics-every")
    checkpoint_every: int = Field(1, ge=1, description="with a checkpoint folder: save after every k-th step and "
                                  "after the last (--checkpoint-every)")
    keep_checkpoints: int = Field(2, ge=1, description="complete checkpoints kept in the folder, the newest "
                                  "(--keep-checkpoints)")
    checkpoint_async: bool = Field(False, description="stage each checkpoint to host memory and write it in the "
                                   "background while training goes on (--async-checkpoint)")
    skip_nonfinite: bool = Field(False, description="a step whose loss or gradient norm is not finite is skipped "
                                 "(no update, counted in the log) instead of stopping the run (--skip-nonfinite)")

    @property
    def fp8_activation_storage(self) -> bool:
        """Whether activations are stored by V3's FP8 recipe: fp8_storage, or fp8 when that is unset."""
        return self.fp8 if self.fp8_storage is None else self.fp8_storage


class RunConfig(BaseModel):
    """Everything one run needs."""

    model_config = ConfigDict(extra="forbid")
    model: ModelConfig
    parallel: ParallelConfig
    recompute: RecomputeConfig = Field(default_factory=RecomputeConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)

    @model_validator(mode="after")
    def _layout(self) -> "RunConfig":
        stages = self.parallel.num_stages
        if self.model.num_blocks < stages:
            raise ValueError(f"model.num_blocks={self.model.num_blocks} cannot fill {stages} pipeline stages "
                             f"(parallel.schedule={self.parallel.schedule}, parallel.ranks={self.parallel.ranks}); "
                             "use fewer ranks or more blocks")
        from schedules.build import build

        par = self.parallel
        if par.stage_split is not None:
            cut = par.stage_split
            if len(cut) != stages or sum(cut) != self.model.num_blocks or min(cut) < 1:
                raise ValueError(f"parallel.stage_split={cut}: needs {stages} entries (the stages of one "
                                 f"{par.schedule} pipeline of {par.ranks} ranks), each >= 1, summing to "
                                 f"model.num_blocks={self.model.num_blocks}")
        if par.microbatches % par.data_parallel:
            raise ValueError(f"parallel.microbatches={par.microbatches} must be a multiple of parallel.data_parallel="
                             f"{par.data_parallel} (--dp): each data-parallel pipeline runs M / data_parallel")
        try:  # the generator owns the M/P rules and their messages
            build(par.schedule, par.ranks, par.microbatches_per_replica)
        except ValueError as err:
            per = (f" (per data-parallel pipeline: {par.microbatches} / {par.data_parallel})"
                   if par.data_parallel > 1 else "")
            raise ValueError(f"parallel: {err}{per}") from None
        moe = self.model.moe
        if moe is None and self.parallel.expert_parallel > 1:
            raise ValueError(f"parallel.expert_parallel={self.parallel.expert_parallel}, but model "
                             f"{self.model.name!r} has no MoE (model.moe) to split over experts; use 1")
        if moe is not None and moe.num_experts % self.parallel.expert_parallel:
            raise ValueError(f"parallel.expert_parallel={self.parallel.expert_parallel} (--ep) must divide "
                             f"model.moe.num_experts={moe.num_experts}")
        if par.data_parallel % par.expert_parallel:  # the layout the runtime's mesh makes (pipeline.distributed)
            raise ValueError(f"parallel.expert_parallel={par.expert_parallel} (--ep) must divide "
                             f"parallel.data_parallel={par.data_parallel} (--dp): expert-parallel groups are cut out "
                             f"of the data-parallel ranks, so the world (ranks x data_parallel = "
                             f"{par.ranks * par.data_parallel} GPUs) must hold EP ranks per pipeline stage")
        return self

    def with_residual(self, variant: str, n: int, active: int | None = None) -> "RunConfig":
        """The same run with another residual variant (e.g. the n=1 baseline of an mHC run); `active`: xHC's k
        (None: its default). The xHC-only fields are reset when the new variant is not xhc."""
        update: dict = {"variant": variant, "n": n, "active": active if variant == "xhc" else None}
        if variant != "xhc":
            update["flash"] = False
        residual = self.model.residual.model_copy(update=update)
        residual = MHCConfig.model_validate(residual.model_dump())
        return self.model_copy(update={"model": self.model.model_copy(update={"residual": residual})})


def config_stage_blocks(cfg: "RunConfig") -> list[range]:
    """The blocks of each stage of one pipeline: parallel.stage_split when the config gives one, else
    `stage_blocks` (as even as possible)."""
    cut = cfg.parallel.stage_split
    if cut is None:
        return stage_blocks(cfg.model.num_blocks, cfg.parallel.num_stages)
    out, start = [], 0
    for size in cut:
        out.append(range(start, start + size))
        start += size
    return out


def stage_blocks(num_blocks: int, num_stages: int) -> list[range]:
    """Blocks of each stage, as even as possible; the first `num_blocks % num_stages` stages take one extra
    block (e.g. 30 blocks on 8 stages: 4,4,4,4,4,4,3,3)."""
    if num_blocks < num_stages:
        raise ValueError(f"{num_blocks} blocks cannot fill {num_stages} stages")
    base, extra = divmod(num_blocks, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def presets() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def load_config(source: str | Path, overrides: dict | None = None) -> RunConfig:
    """Load a RunConfig from a YAML path or a preset name (a file in configs/), with optional nested overrides
    such as {"parallel": {"ranks": 8}}. Errors name the field: `parallel.ranks: Input should be ...`."""
    data, path = load_config_data(source, overrides)
    return parse_config(data, str(path))


def load_config_data(source: str | Path, overrides: dict | None = None) -> tuple[dict, Path]:
    """The raw mapping of a config file (with overrides) before validation, and the file's path."""
    import yaml

    path = Path(source)
    if not path.suffix:
        path = CONFIG_DIR / f"{source}.yaml"
        if not path.exists():
            raise ValueError(f"unknown preset {str(source)!r}; choose one of {', '.join(presets())} "
                             "or give a YAML path")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ValueError(f"{path}: no such config file") from None
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping with model/parallel/recompute/train sections")
    for section, values in (overrides or {}).items():
        if isinstance(values, dict):
            current = data.get(section)
            if current is None:  # `parallel:` with nothing under it
                current = data[section] = {}
            if not isinstance(current, dict):
                raise ValueError(f"{path}: {section}: expected a mapping of fields, got {type(current).__name__} "
                                 f"{current!r}")
            current.update(values)
        else:
            data[section] = values
    return data, path


def parse_config(data: dict, source: str = "<config>") -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        msg = first["msg"].removeprefix("Value error, ")  # our validators' messages name their fields
        raise ValueError(f"{source}: {where}: {msg}" if where else f"{source}: {msg}") from None
