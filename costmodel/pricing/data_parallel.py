"""Data parallelism around one simulated pipeline: where the ranks sit on nodes and what the step's gradient
all-reduce adds (costmodel.md §2.3).

`predict` prices one pipeline (one data-parallel replica). A run of D replicas also sums every stage's gradients
over its copies; this module prices that reduction on top of the pipeline's simulation and says how much of it
the step exposes. `mhcpipe tune` adds it to its objective.

Shape letters: P pipeline ranks, D data-parallel replicas, EP expert-parallel degree (divides D), g GPUs per
node, k ranks in one all-reduce group, S bytes one rank reduces.

The runtime's rules (pipeline/distributed/layout.py, pipeline/distributed/grad_reduce.py), followed here:
* Placement: global rank = pipeline rank x D + dp rank, g consecutive global ranks per node; an EP group is EP
  consecutive dp ranks.
* Groups: a model chunk's dense parameters are summed over its D replicas, its routed experts over the D / EP
  replicas that hold the same experts; DualPipe holds every chunk on two pipeline ranks (both copies join the
  same all-reduce, so k doubles).
* When: a stage's bucket is posted when the last action of the step that writes its gradients ends (its last W,
  I or B, or the B half of an F&B), the dense bucket first, then the experts'; nothing waits for it before the
  optimizer, so it runs under the rest of the step.
* Bytes: gradients have the parameters' dtype, fp32 (fp64 with train.dtype float64; configs.models.TrainConfig).

The model (assumptions, stated in the tuner's output):
* Ring all-reduce, alpha-beta (costmodel.md §2.3): 2(k-1) alpha + 2(k-1)/k S / (bw eta), on NVLink (hw.intra)
  when the whole group sits in one node, else on the network (hw.inter): a ring runs at its slowest hop.
* The buckets of one pipeline rank's replicas run one at a time (dense and expert groups share the rank's
  NVLink and NIC); a group starts when its last member has posted and its members' links are free.
* Optimistic: the reduction does not slow the compute it runs under (NCCL's ring kernels take SMs, §2.5), and
  the optimizer step itself is not priced. Exposed = how far the last reduction ends past the pipeline's end.
"""
from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass

from costmodel.physics.hardware import HardwareSpec, Link
from costmodel.physics.ops import block_params
from configs import RunConfig
from schedules.ir import Schedule
from schedules.simulate import SimResult


@functools.lru_cache(maxsize=4096)
def fewest_ep_ranks_per_node(pp: int, dp: int, ep: int, gpus_per_node: int) -> int:
    """The fewest members of an EP group that share a node, over the runtime's placement (the rank with the
    most of its all-to-all on the network sets the exchange's time): pricing_options.Options.ep_per_node. A group
    starting at global rank s spreads like any other starting at s mod gpus_per_node: each residue is counted
    once (cached: the tuner asks for a few layouts thousands of times)."""
    fewest = ep
    starts = {(p * dp + block * ep) % gpus_per_node for p in range(pp) for block in range(dp // ep)}
    for s in starts:
        nodes = Counter((s + e) // gpus_per_node for e in range(ep))
        fewest = min(fewest, min(nodes.values()))
    return fewest


def ring_allreduce_us(link: Link, k: int, nbytes: float) -> float:
    """2(k-1) alpha + 2(k-1)/k S / (bw eta) (costmodel.md §2.3; nccl-tests' bus-bandwidth factor)."""
    if k <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (k - 1) * link.latency_us + 2 * (k - 1) / k * nbytes / (link.bandwidth * link.efficiency) * 1e6


def routed_expert_params(cfg: RunConfig, block: int, ep: int) -> float:
    """A block's routed-expert parameters on one rank: ops.block_params minus the same block without routed
    experts (EP -> infinity leaves attention, router and shared experts, the dense part)."""
    return block_params(cfg, block, ep) - block_params(cfg, block, math.inf)


@dataclass(frozen=True)
class Bucket:
    """One all-reduce of the step: a chunk's dense or expert gradients."""

    chunk: int
    group: str  # "dense" or "experts"
    ranks: tuple[int, ...]  # pipeline ranks holding the chunk
    k: int  # ranks in the all-reduce
    link: str
    nbytes: float
    posted: float  # us after the step's start, when its last member posted it
    start: float
    end: float


@dataclass(frozen=True)
class GradSync:
    buckets: tuple[Bucket, ...]
    pipeline_us: float  # the pipeline's makespan
    end_us: float  # the step's end: max(pipeline, last reduction)

    @property
    def exposed_us(self) -> float:
        return self.end_us - self.pipeline_us

    @property
    def busiest_us(self) -> float:
        """All-reduce time of the pipeline rank with the most of it (the hidden part included)."""
        per: dict[int, float] = {}
        for b in self.buckets:
            for r in b.ranks:
                per[r] = per.get(r, 0.0) + b.end - b.start
        return max(per.values(), default=0.0)


def last_grad_writes(schedule: Schedule, sim: SimResult) -> dict[int, float]:
    """stage -> end of the last simulated action writing its gradients (W, I, B, or an F&B's B half)."""
    if sim.grad_done is not None:  # the engine's own record (a simulation without spans has only this)
        return sim.grad_done
    last: dict[int, float] = {}
    for s in sim.trace.spans:
        if s.stream != "compute":
            continue
        if s.kind in ("W", "I", "B"):
            stage = s.stage
        elif s.kind == "FB" and s.partner is not None:
            stage = s.partner[0]
        else:
            continue
        last[stage] = max(last.get(stage, 0.0), s.start + s.duration)
    return last


@dataclass(frozen=True)
class Reduction:
    """What one all-reduce moves: a chunk's dense or expert gradients over k ranks on one link."""

    chunk: int
    group: str  # "dense" or "experts"
    stages: tuple[int, ...]  # the stages holding the chunk (two for DualPipe)
    ranks: tuple[int, ...]  # their pipeline ranks
    k: int
    link: Link
    nbytes: float

    @property
    def us(self) -> float:
        return ring_allreduce_us(self.link, self.k, self.nbytes)


def reductions(cfg: RunConfig, hw: HardwareSpec, schedule: Schedule, layout: dict[int, tuple[range, bool, bool]],
               stage_params: dict[int, float]) -> list[Reduction]:
    """The step's all-reduces (k > 1), dense before experts per chunk. `layout` is pricing.resolve_layout's
    (stage -> blocks, first, last), `stage_params` the parameters one rank holds per stage
    (memory.StageMemory.params, routed experts already divided by EP)."""
    par = cfg.parallel
    D, EP, g = par.data_parallel, par.expert_parallel, hw.gpus_per_node
    grad_bytes = 8 if cfg.train.dtype == "float64" else 4
    chunks: dict[int, list[int]] = {}  # position in a pipeline chain -> the stages holding that chunk
    for chain in schedule.pipelines:
        for pos, st in enumerate(chain):
            chunks.setdefault(pos, []).append(st)

    def link_of(lowest: int, highest: int) -> Link:
        """The link of a group whose global ranks run from `lowest` to `highest`: one node holds them all exactly
        when it holds both ends (a rank's node, rank // g, never decreases with the rank)."""
        return hw.intra if lowest // g == highest // g else hw.inter

    out = []
    for pos, stages in sorted(chunks.items()):
        holders = tuple(sorted({schedule.stage_to_rank[s] for s in stages}))
        expert = sum(routed_expert_params(cfg, b, EP) for b in layout[stages[0]][0])
        dense = stage_params[stages[0]] - expert
        # global rank p * D + d: pipeline rank p's data-parallel replica d
        lo, hi = holders[0] * D, holders[-1] * D
        groups = [("dense", len(holders) * D, link_of(lo, hi + D - 1), dense)]
        k_exp = len(holders) * (D // EP)
        if expert > 0 and k_exp > 1:  # one group per expert rank e (ranks p * D + b * EP + e over p and b < D / EP):
            # the slowest placement sets the time
            links = [link_of(lo + e, hi + (D // EP - 1) * EP + e) for e in range(EP)]
            groups.append(("experts", k_exp, min(links, key=lambda lk: lk.bandwidth * lk.efficiency), expert))
        out += [Reduction(pos, name, tuple(stages), holders, k, link, params * grad_bytes)
                for name, k, link, params in groups if k > 1 and params > 0]
    return out


def sync_floor(schedule: Schedule, reds: list[Reduction]) -> dict[int, float]:
    """Per pipeline rank, the all-reduce time that must follow its last action: that action writes a stage's
    gradients (W, I, B or an F&B's B half), whose chunk's reductions are posted no earlier. A step lasts at
    least the rank's busy time plus this."""
    per_stage: dict[int, float] = {}
    for red in reds:
        for s in red.stages:
            per_stage[s] = per_stage.get(s, 0.0) + red.us
    out = {}
    for r, acts in enumerate(schedule.actions):
        last = acts[-1] if acts else None
        stage = None if last is None else (last.b_stage if last.kind.value == "FB" else last.stage)
        out[r] = per_stage.get(stage, 0.0) if last is not None and last.kind.value in ("W", "I", "B", "FB") else 0.0
    return out


def grad_sync(cfg: RunConfig, hw: HardwareSpec, schedule: Schedule, sim: SimResult,
              layout: dict[int, tuple[range, bool, bool]], stage_params: dict[int, float]) -> GradSync:
    """The step's gradient all-reduces for `cfg.parallel.data_parallel` replicas of the simulated pipeline
    (arguments as for `reductions`)."""
    posted = last_grad_writes(schedule, sim)
    free: dict[int, float] = {}
    buckets = []
    pending = [(max(posted.get(s, sim.makespan) for s in red.stages), i, red)
               for i, red in enumerate(reductions(cfg, hw, schedule, layout, stage_params))]
    for when, _, red in sorted(pending, key=lambda x: (x[0], x[1])):
        start = max([when] + [free.get(r, 0.0) for r in red.ranks])
        end = start + red.us
        for r in red.ranks:
            free[r] = end
        buckets.append(Bucket(red.chunk, red.group, red.ranks, red.k, red.link.name, red.nbytes, when, start, end))
    end = max([sim.makespan] + [b.end for b in buckets])
    return GradSync(tuple(buckets), sim.makespan, end)
