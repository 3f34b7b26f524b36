"""Which blocks each stage holds (`resolve_layout`: the runtime's even split, the config's own parallel.stage_split, or
cut by cost) and the cut by cost (parallel.stage_split 'balanced', `predict --split balanced`): the blocks of a
pipeline cut so that the busiest rank's work is as small as the blocks allow.

Why: the even split (configs.stage_blocks) gives every stage the same number of blocks, but the ends carry more:
the first stage the embedding, the last the head, its loss and the MTP module (a block, its prelude and a second
pass through the head); and a rank holds more than one stage under DualPipe (chunk r of one direction and chunk
P-1-r of the other) and DualPipeV (stages r and 2P-1-r), so ranks 0 (and P-1) carry both ends. On DeepSeek-V3's
DualPipe PP16 the even split leaves ranks 0 and 15 with the embedding, 4 + 3 blocks, the head and the MTP block.

Cost of a piece: its forward, input-gradient and weight-gradient kernels at their roofline times on the hardware
(costmodel.physics.hardware: matmul, vector and memory curves; all-to-all and P2P are the same for every MoE block
and left out). A rank's cost is the sum over the stages it holds, every pipeline of the schedule counted (each
runs its share of the micro-batches). The split: start from the even one and move single block boundaries while
the busiest rank's cost falls (then the sum of squares, to leave plateaus); every stage keeps at least one block.
"""
from __future__ import annotations

from costmodel.physics.hardware import HardwareSpec
from costmodel.physics.ops import Shape, block_work, embedding, head, mtp_prelude
from configs import RunConfig, config_stage_blocks, stage_blocks
from schedules.ir import Schedule


def _work_us(hw: HardwareSpec, works) -> float:
    total = 0.0
    for w in works:
        for k in (*w.F, *w.I, *w.W):
            if k.cls == "matrix":
                total += hw.matmul_us(k.flops, k.nbytes, k.dtype, op=k.op)
            elif k.cls == "vector":
                total += hw.vector_us(k.flops, k.nbytes)
            elif k.cls == "memory":
                total += hw.memory_us(k.nbytes)
    return total


def piece_costs(cfg: RunConfig, hw: HardwareSpec) -> tuple[list[float], float, float]:
    """(each block's cost, the first stage's extra, the last stage's extra), microseconds per micro-batch."""
    s = Shape.of(cfg)
    nb = cfg.model.num_blocks
    per_kind: dict[bool, float] = {}  # ops.block_work reads the block index only to tell dense from MoE
    blocks = []
    for b in range(nb):
        dense = s.moe is None or b < s.first_dense
        if dense not in per_kind:
            per_kind[dense] = _work_us(hw, block_work(s, b))
        blocks.append(per_kind[dense])
    first = _work_us(hw, [embedding(s)])
    last = _work_us(hw, [head(s)]) + s.mtp * _work_us(hw, [*block_work(s, nb), head(s), mtp_prelude(s)])
    return blocks, first, last


def rank_positions(schedule: Schedule) -> list[list[int]]:
    """Per rank, the positions (0 = first stage of a pipeline) of the stages it holds, over every pipeline."""
    out: list[list[int]] = [[] for _ in range(schedule.num_ranks)]
    where = schedule.stage_to_rank
    for chain in schedule.pipelines:
        for pos, st in enumerate(chain):
            out[where[st]].append(pos)
    return out


def balanced_split(cfg: RunConfig, hw: HardwareSpec, schedule: Schedule,
                   pieces: tuple[list[float], float, float] | None = None) -> list[range]:
    """The blocks of each pipeline position (module docstring). `pieces`: piece_costs(cfg, hw) when the caller
    has it (the tuner cuts many schedules of one shape)."""
    S = len(schedule.pipelines[0])
    nb = cfg.model.num_blocks
    costs, first, last = piece_costs(cfg, hw) if pieces is None else pieces
    held = [tuple(ps) for ps in rank_positions(schedule) if ps]
    width = {len(ps) for ps in held}  # positions per rank: one (1F1B, ZB) or two (DualPipe's V and its two chains)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def score(edges: list[int]) -> tuple[float, float]:
        chunk = [prefix[edges[i + 1]] - prefix[edges[i]] for i in range(S)]
        chunk[0] += first
        chunk[-1] += last
        # a rank's load summed in the order sum() adds (the tuner scores ~10^4 cuts a search)
        if width == {1}:
            loads = [chunk[a] for (a,) in held]
        elif width == {2}:
            loads = [chunk[a] + chunk[b] for a, b in held]
        else:
            loads = [sum(chunk[p] for p in ps) for ps in held]
        return max(loads), sum(x * x for x in loads)

    edges = [0, *(r.stop for r in stage_blocks(nb, S))]
    best = score(edges)
    while True:
        found = None
        for i in range(1, S):
            for step in (-1, 1):
                e = edges[i] + step
                if edges[i - 1] < e < edges[i + 1]:
                    trial = edges[:i] + [e] + edges[i + 1:]
                    got = score(trial)
                    if got < best and (found is None or got < found[0]):
                        found = (got, trial)
        if found is None:
            return [range(edges[i], edges[i + 1]) for i in range(S)]
        best, edges = found


def rank_loads(cfg: RunConfig, hw: HardwareSpec, schedule: Schedule, split: list[range]) -> list[float]:
    """Each rank's cost under `split` (for reports: max / mean)."""
    costs, first, last = piece_costs(cfg, hw)
    chunk = [sum(costs[b] for b in r) for r in split]
    chunk[0] += first
    chunk[-1] += last
    return [sum(chunk[p] for p in ps) for ps in rank_positions(schedule)]


def resolve_layout(cfg: RunConfig, schedule: Schedule, allow_uneven: bool, *, split: str = "even",
                   hw: HardwareSpec | None = None) -> dict[int, tuple[range, bool, bool]]:
    """stage -> (blocks, is first of its pipeline, is last). `split` 'balanced' (with `hw`): the blocks cut by cost
    (balanced_split below), uneven by design."""
    nb = cfg.model.num_blocks
    if split == "balanced":
        if hw is None:
            raise ValueError("a balanced stage split prices the blocks: give the hardware")
        if nb < len(schedule.pipelines[0]):
            raise ValueError(f"{nb} blocks cannot fill {len(schedule.pipelines[0])} pipeline stages "
                             f"({schedule.kind}, {schedule.num_ranks} ranks); use fewer ranks")
        return _place(schedule, balanced_split(cfg, hw, schedule))
    if split != "even":
        raise ValueError(f"stage split {split!r}: 'even' or 'balanced'")
    if cfg.parallel.stage_split is not None:  # the config's own cut (checked against num_stages by RunConfig)
        return _place(schedule, config_stage_blocks(cfg))
    for chain in schedule.pipelines:
        S = len(chain)
        if nb < S:
            raise ValueError(f"{nb} blocks cannot fill {S} pipeline stages ({schedule.kind}, {schedule.num_ranks} "
                             "ranks); use fewer ranks")
        if nb % S and not (allow_uneven or cfg.parallel.uneven_stages):
            sizes = [len(r) for r in stage_blocks(nb, S)]
            divisors = [p for p in range(1, nb + 1) if nb % p == 0]
            raise ValueError(f"{nb} blocks do not divide evenly into {S} stages (would be {sizes}); choose a layout "
                             f"whose stage count divides {nb} (stages per pipeline: {divisors}) or allow uneven "
                             "stages (--uneven, or parallel.uneven_stages: true in the config)")
    return _place(schedule, stage_blocks(nb, len(schedule.pipelines[0])))


def _place(schedule: Schedule, cut: list[range]) -> dict[int, tuple[range, bool, bool]]:
    """Every pipeline's stages given the blocks of `cut` in chain order: stage -> (blocks, first, last)."""
    out: dict[int, tuple[range, bool, bool]] = {}
    for chain in schedule.pipelines:
        for pos, (st, blocks) in enumerate(zip(chain, cut)):
            out[st] = (blocks, pos == 0, pos == len(chain) - 1)
    return out
