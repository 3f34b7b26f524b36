"""One pipeline stage of a user's model (pipeline.user_model): the same generator protocol as the built-in
`Stage`, so the executor, the F&B pair runner, the gradient reduction, checkpoints and traces treat both alike.

Shape letters: T tokens of a micro-batch, n streams, C hidden.

Segments: on a pipeline's first stage the embedding and stream entry (ids -> [T, n, C]: the only place streams are
expanded), then one segment per block, then on its last stage the head (the stream reduction and the logits) with
the loss. Every segment starts from a detached leaf, so backward runs block by block and the stage's input-grad is
the first segment's leaf grad. A stage that receives its input gets [T, n, C] from the previous stage and hands
its blocks the micro-batch's token ids when one asks (`needs_token_ids`).

Segments of a block that exposes phases (pipeline.user_model) are its phases: a phase's state may be a tuple, whose
floating tensors become the next segment's leaves and whose other values pass on as they are; a stage holding such a
block `exchanges`, so the executor's F&B pair hands the turn between its halves at every segment boundary.

Also here: `agreed_block_costs` (the costs every rank cuts the model by, measured on rank 0 and broadcast) and
`run_note` (what the run says once about a user model).

`probe` (check-split): called with (what, stage, mb, tensor) for what crosses this stage's boundaries - "in" (the
state it received), "out" (the state it sends), "loss", "grad_out" (the gradient it received), "grad_in" (the
gradient it sends) - so a difference from the unsplit model is named by stage and micro-batch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the type of every `cfg` here; configs is imported where it is used
    from configs import RunConfig

import torch
from torch import nn
from torch.autograd.graph import GradientEdge

from pipeline.partition import StageSpec
from pipeline.runtime.boundary import BoundaryLayout
from pipeline.runtime.stage import ChunkRun
from pipeline.user_model import Parts, UserModel
from pipeline.weight_grad import DeferLinear, WeightGradStore, attach_store


class UserStage(nn.Module):
    def __init__(self, spec: StageSpec, model: UserModel, *, dtype: torch.dtype, microbatches: int, probe=None,
                 store: WeightGradStore | None = None, recompute=None, boundary: BoundaryLayout | None = None):
        """`store`: the rank's deferred weight-gradient store, attached to every DeferLinear of the stage (a user
        block built with pipeline.weight_grad.DeferLinear gets the B/W split of ZB1P and DualPipe). `recompute`:
        the run's RecomputeConfig (`recompute_units`). `boundary`: the layout a state of several tensors crosses
        a stage boundary in (UserModel.extra_state), None for the streams alone."""
        super().__init__()
        self.spec = spec
        self.model = model
        self.parts = Parts(model, spec.blocks, embed=spec.has_embed, head=spec.has_head)
        attach_store(self.parts, store)
        self.defers = any(isinstance(m, DeferLinear) for m in self.parts.modules())
        self.dtype = dtype
        self.microbatches = microbatches
        self.probe = probe
        self.wants_ids = model.wants_token_ids(spec.blocks)
        self.boundary = boundary
        self.units = recompute_units(spec.blocks, recompute)
        # a recomputed unit runs its blocks' forwards as one segment (its phases are not interleaved)
        self.phases = {b: None if self.units else model.phases(b) for b in spec.blocks}
        first, end = 2 * spec.blocks[0], 2 * spec.blocks[-1] + 2
        pieces = [f"L{2 * u.start}.block" for u in self.units] if self.units else \
            [f"L{2 * b}.{name}" for b in spec.blocks for name, _ in (self.phases[b] or [("block", None)])]
        self.labels = ([f"L{first}.embed"] if spec.has_embed else []) + pieces + \
            ([f"L{end}.head"] if spec.has_head else [])
        # an F&B pair interleaves its halves at segment boundaries only where a block exposes phases (the executor
        # runs the halves of other pairs one after the other: there is nothing to interleave)
        self.exchanges = any(p is not None for p in self.phases.values())

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """By the model's global names (`embed.*`, `blocks.<b>.*`, `head.*`), not under `parts.`."""
        return self.parts.named_parameters(prefix, recurse, remove_duplicate)

    def _tell(self, what: str, mb: int, t) -> None:
        if self.probe is not None and t is not None:
            self.probe(what, self.spec.stage, mb,
                       tuple(v.detach() for v in t) if type(t) is tuple else t.detach())

    def forward_steps(self, run: ChunkRun, inp: torch.Tensor, labels: torch.Tensor | None, env):
        mb, model = run.mb, self.model
        ids = run.ids
        if self.spec.has_embed:
            ids = inp
            x = model.embed_tokens(inp, self.dtype)
            run.segs.append((None, x, None))
            yield
        else:
            x = self.boundary.unpack(inp) if self.boundary is not None else inp
            self._tell("in", mb, x)
        t = (x[0] if type(x) is tuple else x).shape[0]
        for unit in self.units or ():
            # only the unit's input is kept; its backward reruns the blocks' forwards from it (`_Recompute`)
            leaf = tuple(v.detach() for v in x) if type(x) is tuple else x.detach()
            rec = _Recompute(unit, ids, torch.get_rng_state(), env.dev.rng_state() if env.dev is not None else None)
            with torch.no_grad():
                x = self._run_unit(leaf, ids, unit)
            run.segs.append((leaf, None, rec))
            yield
        for b in () if self.units else self.spec.blocks:
            phases = self.phases[b]
            if phases is None:
                leaf = _leaves(x)
                with env.saved.hooks():
                    x = model.run_block(b, leaf, ids)
                run.segs.append((leaf, x, None))
                yield
                continue
            for k, (name, fn) in enumerate(phases):
                leaf = _leaves(x)
                with env.saved.hooks():
                    x = model.run_phase(b, name, fn, leaf, ids, k == len(phases) - 1, t)
                run.segs.append((leaf, x, None))
                yield
        if self.spec.has_head:
            leaf = _leaves(x)
            with env.saved.hooks():
                loss = model.micro_loss(leaf, labels, self.microbatches)
            run.segs.append((leaf, loss, None))
            run.loss = loss.detach()
            self._tell("loss", mb, run.loss)
            yield
        else:
            # one message per boundary: a state of several tensors packed (pipeline.runtime.boundary)
            run.output = self.boundary.pack(x) if self.boundary is not None else x.detach()
            self._tell("out", mb, x)

    def _run_unit(self, x: torch.Tensor, ids, unit: range) -> torch.Tensor:
        for b in unit:
            x = self.model.run_block(b, x, ids)
        return x


    def backward_steps(self, run: ChunkRun, grad: torch.Tensor | None, env):
        if grad is not None and self.boundary is not None:
            grad = self.boundary.unpack(grad)
        self._tell("grad_out", run.mb, grad)
        g = grad
        while run.segs:
            leaf, out, rec = run.segs.pop()
            if rec is not None:  # a recompute unit: its forward again, saving for this backward only
                for v in _items(leaf):
                    if v.is_floating_point():
                        v.requires_grad_(True)
                out = rec.rerun(self, leaf, env)
            if g is None:  # the head's loss
                torch.autograd.backward(out)
            else:
                outs, grads = [], []
                for o, go in zip(_items(out), _items(g)):
                    # the stage's sent output is held as its gradient edge (ChunkRun.release_output)
                    if go is not None and (isinstance(o, GradientEdge) or torch.is_tensor(o) and o.requires_grad):
                        outs.append(o)
                        grads.append(go)
                if outs:
                    torch.autograd.backward(outs, grads)
            g = None if leaf is None else _leaf_grads(leaf)
            del leaf, out
            yield
        if not self.spec.has_embed:
            self._tell("grad_in", run.mb, g)
        run.input_grad = self.boundary.pack(g) if self.boundary is not None and g is not None else g


class _Recompute:
    """A recompute unit's forward as its backward reruns it: the same blocks on the kept input and token ids, from
    the random state the forward started from (dropout draws the same masks), under the same autocast (the input's
    dtype decides it: pipeline.user_model.amp). The rerun's saved tensors are counted as the step's (a unit's
    transient is part of the stage's peak)."""

    __slots__ = ("unit", "ids", "cpu_rng", "dev_rng")

    def __init__(self, unit: range, ids, cpu_rng: torch.Tensor, dev_rng: torch.Tensor | None):
        self.unit, self.ids, self.cpu_rng, self.dev_rng = unit, ids, cpu_rng, dev_rng

    def rerun(self, stage: "UserStage", leaf: torch.Tensor, env) -> torch.Tensor:
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.cpu_rng)
            kept = env.dev.rng_state() if env.dev is not None else None
            if env.dev is not None:
                env.dev.set_rng_state(self.dev_rng)
            try:
                with torch.enable_grad(), env.saved.hooks():
                    return stage._run_unit(leaf, self.ids, self.unit)
            finally:
                if env.dev is not None:
                    env.dev.set_rng_state(kept)


def recompute_units(blocks: range, recompute) -> list[range] | None:
    """A stage's recompute units (runs of its blocks, each recomputed as one in its backward), or None (off):
    mode 'auto' recomputes the stage's blocks as one unit (the mHC recipe: recompute blocks aligned with pipeline
    stages), 'block' every `block_size` of its blocks (a user's blocks, not sub-layers: mhc-pipe does not see
    inside them)."""
    if recompute is None or recompute.mode == "off":
        return None
    size = len(blocks) if recompute.mode == "auto" else recompute.block_size
    return [range(b, min(b + size, blocks.stop)) for b in range(blocks.start, blocks.stop, size)]


def _items(v) -> tuple:
    """A state's parts: a phase's tuple, or the one tensor (a GradientEdge is a named tuple: one part)."""
    return v if type(v) is tuple else (v,)


def _leaves(state):
    """A segment's inputs: floating tensors as fresh leaves (their gradients are what the segment hands back),
    anything else (integer routing indices, a communication handle) passed on as it is."""
    def one(v):
        if torch.is_tensor(v) and v.is_floating_point():
            return v.detach().requires_grad_(True)
        return v
    return tuple(one(v) for v in state) if type(state) is tuple else one(state)


def _leaf_grads(leaf):
    """The gradients of a segment's input leaves, in its state's form (zeros where a leaf was not used)."""
    def one(v):
        if torch.is_tensor(v) and v.requires_grad:
            return v.grad if v.grad is not None else torch.zeros_like(v)
        return None
    return tuple(one(v) for v in leaf) if type(leaf) is tuple else one(leaf)


def agreed_block_costs(model: UserModel, cfg: RunConfig, device: torch.device, groups, dev=None) -> list[int] | None:
    """The costs every rank balances its stages by: None for parameter counts; `balance` 'measured': rank 0 times
    every block on one micro-batch (pipeline.user_model.UserModel.measure_block_costs) and broadcasts the numbers,
    so every rank cuts the model at the same blocks (timings differ from rank to rank)."""
    if model.balance != "measured":
        return None
    from pipeline.user_materialise import on_meta

    if on_meta(model):  # every rank decides this alike, before rank 0 would time anything
        raise ValueError("UserModel.balance 'measured' times blocks on real tensors: a model built on the meta device "
                         "is balanced by 'params' (or give split_points)")
    import torch.distributed as dist

    from pipeline.distributed.collective import collective, group_device, synchronize
    from pipeline.model import activation_dtype

    world = groups.world_group if groups is not None else None
    tokens = cfg.parallel.tokens_per_microbatch
    rank = groups.rank if groups is not None else 0

    def sync() -> None:  # the device's queued work, before and after each timed block (CUDA)
        synchronize(dev, (), cfg.train.timeout_s, "timing the blocks", rank)

    mine = torch.tensor(model.measure_block_costs(tokens, device, activation_dtype(cfg.train.dtype), sync=sync)
                        if world is None or groups.rank == 0 else [0] * len(model.blocks), dtype=torch.int64)
    if world is not None:
        mine = mine.to(group_device(world, device))
        collective(dist.broadcast, mine, 0, what="the measured block costs broadcast", rank=groups.rank,
                   timeout_s=cfg.train.timeout_s, group=world)
    return [int(c) for c in mine.tolist()]


def run_note(kinds: set[str], overlap: bool, stages) -> str | None:
    """What runs differently for a user model, said once (rank 0, from its action kinds and stages): how its F&B
    pairs' halves share the rank (interleaved at the phases of blocks that expose them, else one after the other),
    and, where its blocks hold no DeferLinear, that its I computes the weight-gradients too, so W has nothing to do."""
    said = []
    if "FB" in kinds and overlap:
        if any(st.exchanges for st in stages):
            said.append("F&B pairs hand the turn between their halves at every phase boundary of its phased blocks")
        else:
            said.append("F&B pairs run their halves one after the other (its blocks expose no phases to interleave)")
    if "W" in kinds and not any(st.defers for st in stages):
        said.append("I computes the weight-gradients too and W is empty (its blocks hold no DeferLinear, "
                    "pipeline.weight_grad)")
    return f"note: a user model: {'; '.join(said)}" if said else None
