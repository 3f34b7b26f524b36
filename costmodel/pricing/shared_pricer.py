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

from costmodel.physics.memory import StageMemory
from costmodel.pricing.pricer import Pricer
from costmodel.pricing.fb_overlap import TimedOp
from schedules.ir import Action, Kind


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

    def _stage_memory(self, stage: int, blocks: range, first: bool, last: bool) -> StageMemory:
        """A stage's memory terms depend on the shape, the recompute choice and which blocks it holds, not on its
        index: computed once per such key for every candidate (a copy per stage index: candidates share them, and
        dataclasses.replace costs more than the lookup)."""
        prefix = self.__dict__.get("_memory_key")
        if prefix is None:  # the config's part, once per pricer (its stages all ask)
            c = self.cfg
            prefix = self._memory_key = ("stage memory", c.parallel.microbatch_size, c.parallel.seq_len,
                                         c.parallel.expert_parallel, c.recompute.mode, c.recompute.block_size,
                                         c.train.dtype, c.train.fp8, c.train.fp8_storage, self.recompute)
        key = prefix + (blocks[0] if len(blocks) else -1, len(blocks), first, last)
        mine = self.shared.get((key, stage))
        if mine is None:
            got = self.shared.get(key)
            if got is None:
                got = self.shared[key] = super()._stage_memory(stage, blocks, first, last)
            mine = self.shared[(key, stage)] = replace(got, stage=stage)
        return mine

    def _chain(self, kind: Kind, stage: int) -> list[TimedOp]:
        """A chain is timed by what a price depends on (`common` and the stage key): built once for every candidate
        (an F&B pair's halves are the F and B chains other layouts of the search built already)."""
        key = ("chain",) + self.common + (kind.value, self.chain_key[kind][stage])
        chain = self.shared.get(key)
        if chain is None:
            chain = self.shared[key] = self._build_chain(kind, stage)
        return chain

    def compute_time(self, a: Action) -> float:
        key = self.common + self._shape_key(a)
        hit = self.shared.get(key)
        if hit is None:
            t = super().compute_time(a)
            hit = self.shared[key] = (t, self.results.get(self._key(a)))
        elif hit[1] is not None:  # what fb_timing reads back for the pair's release times
            self.results[self._key(a)] = hit[1]
        return hit[0]
