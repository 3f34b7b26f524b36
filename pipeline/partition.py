"""Placement: which blocks, embedding and head each pipeline stage holds, per schedule kind (schedules.md §1).

Shape letters: P ranks, S stages, L_b blocks.

* 1F1B, ZB1P, GPipe: S = P stages, stage s on rank s, one chunk of blocks per rank.
* DualPipeV: S = 2P stages in one V, stage s on rank s (s < P) or 2P-1-s; rank 0 holds the first stage
  (embedding) and the last (head); nothing is duplicated.
* DualPipe: the model is cut into P chunks; direction 0 runs chunk b as stage b on rank b, direction 1 runs
  chunk b as stage P+b on rank P-1-b. Every chunk lives on two ranks (r and P-1-r), and so do the embedding
  (first stage of each direction: ranks 0 and P-1) and the head (last stage of each: ranks P-1 and 0); the
  copies' gradients are summed between the mirrored ranks before the optimizer step.

`RankPlan` is what one rank needs: its stages (with their blocks), the schedule, and its mirror rank for
DualPipe's gradient reduction. Placement follows `Schedule.stage_to_rank` and `Schedule.pipelines`, so a new
generator with the same IR needs no change here beyond the chunk rule.
"""
from __future__ import annotations

from dataclasses import dataclass

from schedules import Schedule, build
from schedules.registry import kind_of

from configs import RunConfig, config_stage_blocks, stage_blocks


@dataclass(frozen=True)
class StageSpec:
    stage: int  # global stage id of the IR
    rank: int
    pipeline: int  # index into Schedule.pipelines (DualPipe: the direction)
    chunk: int  # which cut of the model (DualPipe: the same chunk appears in both directions)
    blocks: range  # Transformer blocks of this stage
    prev: int | None  # previous stage in the pipeline
    next: int | None  # next stage in the pipeline

    @property
    def has_embed(self) -> bool:
        return self.prev is None

    @property
    def has_head(self) -> bool:
        return self.next is None

    @property
    def pieces(self) -> set[str]:
        """The user-model pieces (pipeline.user_model) this stage holds: 'embed', 'expand', 'blocks.<b>', 'head'."""
        out = {f"blocks.{b}" for b in self.blocks}
        if self.has_embed:
            out |= {"embed", "expand"}
        if self.has_head:
            out.add("head")
        return out


@dataclass(frozen=True)
class RankPlan:
    rank: int  # pipeline rank
    schedule: Schedule  # of one data-parallel replica (M / data_parallel micro-batches)
    stages: tuple[StageSpec, ...]  # all stages, by global stage id
    mirror: int | None  # DualPipe: the pipeline rank holding the other copy of this rank's parameters
    dp_rank: int = 0  # which data-parallel replica: its micro-batches are the dp_rank-th slice of the batch

    def local(self) -> list[StageSpec]:
        return [s for s in self.stages if s.rank == self.rank]

    @property
    def num_chunks(self) -> int:
        return len({s.chunk for s in self.stages})


def chunk_count(kind: str, schedule: Schedule) -> int:
    """How many cuts of the model (schedules.registry: P for DualPipe, whose chunks run in both directions; one per
    stage else)."""
    return kind_of(kind).model_chunks(schedule.num_ranks)


def chunks_for(kind: str, num_blocks: int, schedule: Schedule) -> list[range]:
    """Blocks of every model chunk, as even as possible."""
    return stage_blocks(num_blocks, chunk_count(kind, schedule))


def plan_stages(cfg: RunConfig, schedule: Schedule, chunks: list[range] | None = None) -> tuple[StageSpec, ...]:
    """`chunks`: the blocks of every cut (a user model's own partition); default parallel.stage_split when the
    config gives one, else even by block count."""
    kind = cfg.parallel.schedule
    if chunks is None:
        chunks = (config_stage_blocks(cfg) if cfg.parallel.stage_split is not None
                  else chunks_for(kind, cfg.model.num_blocks, schedule))
    prev, nxt = schedule.prev_stage(), schedule.next_stage()
    specs = []
    for p_idx, chain in enumerate(schedule.pipelines):
        for pos, s in enumerate(chain):
            chunk = pos  # position in the chain = which cut of the model (DualPipe: direction 1 reuses 0..P-1)
            specs.append(StageSpec(s, schedule.stage_to_rank[s], p_idx, chunk, chunks[chunk], prev.get(s), nxt.get(s)))
    specs.sort(key=lambda sp: sp.stage)
    if len(chunks) != max(sp.chunk for sp in specs) + 1:
        raise ValueError(f"placement: {len(chunks)} chunks for {kind} but the schedule's pipelines use "
                         f"{max(sp.chunk for sp in specs) + 1}")
    return tuple(specs)


def plan_rank(cfg: RunConfig, rank: int, schedule: Schedule | None = None, dp_rank: int = 0,
              chunks: list[range] | None = None) -> RankPlan:
    """The plan of pipeline rank `rank` in data-parallel replica `dp_rank` (`chunks`: see plan_stages)."""
    par = cfg.parallel
    if schedule is None:
        schedule = build(par.schedule, par.ranks, par.microbatches_per_replica)
    if not 0 <= rank < schedule.num_ranks:
        raise ValueError(f"rank {rank} outside the {schedule.num_ranks} ranks of parallel.ranks")
    mirror = schedule.num_ranks - 1 - rank if kind_of(par.schedule).mirrors else None
    return RankPlan(rank, schedule, plan_stages(cfg, schedule, chunks), mirror, dp_rank)


def global_microbatch(plan: RankPlan, pipeline: int, mb: int) -> int:
    """Index into the step's global batch of micro-batch `mb` of pipeline `pipeline` of this replica: replicas take
    consecutive slices of M / data_parallel (DualPipe: direction d holds the d-th half of its slice)."""
    per_replica = plan.schedule.num_microbatches
    return plan.dp_rank * per_replica + pipeline * plan.schedule.microbatches_per_pipeline + mb
