"""The unsplit run of a user's model (pipeline.user_model): what check-split compares every schedule against.

Shape letters: M micro-batches, T tokens of a micro-batch, n streams, C hidden.

One process, no stages, no P2P: for every micro-batch g of the step's batch, in order, the embedding and stream
entry, every block, the head and the loss, with the token ids handed straight to the blocks that ask. It keeps
the stream state after every block (`states[g, b]`, b = -1 after the stream entry) and, after one backward over the
micro-batch's loss, that state's gradient (`state_grads[g, b]`), so a pipeline stage's boundary tensors can be
compared with the unsplit model's at the same block; parameters' gradients accumulate over the micro-batches as
the pipeline's do. Micro-batches run one at a time with the pipeline's shapes, so no difference comes from
batching a different number of tokens through a kernel.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the type of every `cfg` here; configs is imported where it is used
    from configs import RunConfig

from dataclasses import dataclass, field

import torch

from pipeline.data import make_batch
from pipeline.model import activation_dtype, param_dtype
from pipeline.user_materialise import materialise_all, on_meta
from pipeline.user_model import UserModel


@dataclass
class UnsplitRun:
    states: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (g, b) -> state after block b
    state_grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)  # g -> this micro-batch's share of the loss
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # parameter name -> step gradient
    order: list[str] = field(default_factory=list)  # parameter names in model order

    @property
    def loss(self) -> float:
        return float(sum(self.losses.values()))


def unsplit_run(model: UserModel, cfg: RunConfig, step: int = 0) -> UnsplitRun:
    """One step's forward and backward of the unsplit model on `cfg`'s batch (no optimizer step). The model is
    moved to the run's dtype; contract violations raise pipeline.user_model.ContractError."""
    dtype = activation_dtype(cfg.train.dtype)
    if on_meta(model):  # built on the meta device: every piece, initialised as each stage initialises its own
        materialise_all(model, torch.device("cpu"), cfg.train.seed)
    parts = model.named_parts().to(dtype=param_dtype(cfg.train.dtype))
    batch = make_batch(cfg, step)
    m = cfg.parallel.microbatches
    out = UnsplitRun(order=[name for name, _ in parts.named_parameters()])
    for g in range(m):
        ids, labels = batch.microbatch(g)
        x = _boundary(model.embed_tokens(ids, dtype))
        kept = [x]
        for b in range(len(model.blocks)):
            x = _boundary(model.run_block(b, x, ids))
            kept.append(x)
        loss = model.micro_loss(x, labels, m)
        loss.backward()
        out.losses[g] = loss.detach()
        for b, t in enumerate(kept, start=-1):  # a state of several tensors: a tuple of its parts, each compared
            out.states[g, b] = _each(t, lambda v: v.detach())
            out.state_grads[g, b] = _each(t, lambda v: v.grad.detach() if v.grad is not None else torch.zeros_like(v))
    out.grads = {name: p.grad.detach().clone() for name, p in parts.named_parameters() if p.grad is not None}
    parts.zero_grad(set_to_none=True)
    return out


def _each(state, fn):
    return tuple(fn(v) for v in state) if type(state) is tuple else fn(state)


def _boundary(state):
    """The state as the next block receives it: a view of each part, whose retained gradient is what flows back
    from the blocks after it only, as a stage's received state is a leaf (a part the producing block also used
    itself, e.g. streams it read to compute a deferred term, gets the rest of its gradient through that term)."""
    def one(v):
        v = v.view_as(v)
        if v.requires_grad:
            v.retain_grad()
        return v
    return _each(state, one)
