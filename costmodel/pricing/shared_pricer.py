"""A Pricer whose prices are shared by the pricers of many layouts (`mhcpipe tune`, costmodel/answers/tune.py).

An action's duration depends on the shape (micro-batch size, EP, its placement, the hp stream), on the share of the NIC
the stage-boundary messages take from the all-to-alls (Pricer.nic_bytes, which follows the layout: a key without it
priced some V3 layouts 3.8% fast) and on what its stage holds (Pricer.stage_key), and a stage's memory on the shape,
the recompute choice and which blocks it holds: not on the stage's index or the schedule. One dict, passed in, keeps
them for every candidate of a search (tests/costmodel/test_tune.py checks a whole V3 search's front against
predict).
"""
from __future__ import annotations

from dataclasses import replace

from configs import RunConfig
from costmodel.physics.memory import StageMemory, stage_memory
from costmodel.physics.mhc_cost import ResidualSpec
from costmodel.pricing.pricer import Pricer
from costmodel.pricing.fb_overlap import Chain, TimedOp
from schedules.ir import Action, Kind


def _memory_prefix(cfg: RunConfig, recompute: bool) -> tuple:
    """What of a config a stage's memory depends on (memory.stage_memory), besides the blocks it holds; its last
    entry is the first MoE block's index."""
    p, r, t, moe = cfg.parallel, cfg.recompute, cfg.train, cfg.model.moe
    return ("stage memory", p.microbatch_size, p.seq_len, p.expert_parallel, r.mode, r.block_size, t.dtype, t.fp8,
            t.fp8_storage, recompute, cfg.model.num_blocks if moe is None else moe.first_dense_blocks)


def _shared_stage_memory(shared: dict, prefix: tuple, cfg: RunConfig, spec: ResidualSpec, stage: int, blocks: range,
                         first: bool, last: bool, recompute: bool) -> StageMemory:
    # a block's terms depend only on whether it is dense (memory.stage_memory), and dense blocks come first: the
    # stage's dense and MoE counts say what it holds, wherever it sits in the pipeline
    dense = sum(1 for b in blocks if b < prefix[-1])
    key = prefix + (dense, len(blocks), first, last)
    mine = shared.get((key, stage))
    if mine is None:
        got = shared.get(key)
        if got is None:
            got = shared[key] = stage_memory(cfg, spec, stage, blocks, first, last, recompute)
        mine = shared[(key, stage)] = replace(got, stage=stage)
    return mine


def shared_stage_memories(shared: dict, cfg: RunConfig, spec: ResidualSpec, layout: dict[int, tuple[range, bool, bool]],
                          recompute: bool) -> dict[int, StageMemory]:
    """Each stage's memory terms (memory.stage_memory, what a Pricer's stage_mem holds) from `shared`: they depend on
    the shape, the recompute choice and which blocks the stage holds, not on its index, so they are computed once
    per such key for every candidate of a search (a copy per stage index: dataclasses.replace costs more than the
    lookup). The tuner weighs most layouts' memory with these alone, no pricer built."""
    prefix = _memory_prefix(cfg, recompute)
    return {st: _shared_stage_memory(shared, prefix, cfg, spec, st, blocks, first, last, recompute)
            for st, (blocks, first, last) in layout.items()}


class SharedPricer(Pricer):
    """A Pricer whose action prices and kernel chains are shared by every candidate's pricer, keyed on what they
    depend on (`common` and Pricer.stage_key; module docstring), not on the stage's index or the schedule."""

    def __init__(self, *args, shared: dict, **kw):
        self.shared = shared  # before the Pricer's own set-up, which prices the stages' memory through it
        super().__init__(*args, **kw)
        p = self.cfg.parallel
        # besides the stage key, what an action's kernels are timed by: the shape, the EP placement, the stream,
        # and the NIC share the stage-boundary messages take from the all-to-alls (it follows the layout)
        self.common = (p.microbatch_size, p.expert_parallel, self.opt.ep_per_node, self.opt.hp_stream, self.nic_bytes)
        # a kernel's timing and a block's kernels depend on these alone (the shape's micro-batch and EP, the NIC
        # share, the stream): one table of each for every candidate's pricer with them, filled as chains are built
        self._timed = self.shared.setdefault(("timed",) + self.common, {})
        self._blocks = self.shared.setdefault(("blocks",) + self.common, {})
        self._lagged = self.shared.setdefault(("lagged",) + self.common, {})  # keyed by shape keys and lags too

    def _stage_memory(self, stage: int, blocks: range, first: bool, last: bool) -> StageMemory:
        """From the search's shared table (shared_stage_memories)."""
        prefix = self.__dict__.get("_memory_key")
        if prefix is None:  # the config's part, once per pricer (its stages all ask)
            prefix = self._memory_key = _memory_prefix(self.cfg, self.recompute)
        return _shared_stage_memory(self.shared, prefix, self.cfg, self.spec, stage, blocks, first, last,
                                    self.recompute)

    def _chain(self, kind: Kind, stage: int) -> list[TimedOp]:
        """A chain is timed by what a price depends on (`common` and the stage key): built once for every candidate
        (an F&B pair's halves are the F and B chains other layouts of the search built already)."""
        key = ("chain",) + self.common + (kind.value, self.chain_key[kind][stage])
        chain = self.shared.get(key)
        if chain is None:
            chain = self.shared[key] = Chain(self._build_chain(kind, stage))
        return chain

    def floor_time(self, a: Action) -> float:
        key = ("floor",) + self.common + self._shape_key(a)
        got = self.shared.get(key)
        if got is None:
            got = self.shared[key] = super().floor_time(a)
        return got

    def compute_time(self, a: Action) -> float:
        key = self.common + self._shape_key(a)
        hit = self.shared.get(key)
        if hit is None:
            t = super().compute_time(a)
            hit = self.shared[key] = (t, self.results.get(self._key(a)))
        elif hit[1] is not None:  # what fb_timing reads back for the pair's release times
            self.results[self._key(a)] = hit[1]
        return hit[0]
