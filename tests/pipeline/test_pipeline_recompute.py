"""mHC recompute: bitwise-equal gradients, the memory Table 3 predicts, blocks cut per stage by Eq. 20.

Memory is measured twice: by the runtime's own counter (pipeline.runtime.saved_tensors.SavedTensors, a saved-tensor
hook) and from outside it, by `StorageTracker`: weak references to every storage an op allocates during the
stage's forward and backward, so a tensor kept alive anywhere (a saved tensor, a recompute cache never
released, a reference cycle) is seen whether or not the runtime's counter knows about it.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from _pipeline_helpers import tiny_config
from configs import eq20_block_size, parse_config
from pipeline.partition import StageSpec
from pipeline.observability.recorder import Recorder
from pipeline.runtime.saved_tensors import SavedTensors
from pipeline.runtime.stage import ChunkRun, Stage, StageEnv
from pipeline.runtime.train import RankRuntime

T, C, BLOCKS = 32, 32, 4  # tokens, hidden, blocks of the middle stage (8 sub-layers)


def _storage_id(t: torch.Tensor) -> int:
    return StorageWeakRef(t.untyped_storage()).cdata


class StorageTracker(TorchDispatchMode):
    """Weak references to every storage an op allocates while the mode is active (outputs that share an input's
    storage, views and in-place ops, are not new allocations). `live_bytes` sums the ones still alive."""

    def __init__(self):
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_id(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)
                old = self.refs.get(ref.cdata)
                if ref.cdata not in inputs and (old is None or old[0].expired()):
                    self.refs[ref.cdata] = (ref, storage.nbytes())
        return out

    def live(self, exclude=()) -> dict[int, int]:
        skip = {_storage_id(t) for t in exclude if t is not None}
        return {k: nbytes for k, (ref, nbytes) in self.refs.items() if not ref.expired() and k not in skip}


def _run_stage(n: int, rc_block: int | None):
    cfg = parse_config(tiny_config("1f1b", 2, n=n))
    spec = StageSpec(stage=1, rank=0, pipeline=0, chunk=1, blocks=range(0, BLOCKS), prev=0, next=2)  # a middle stage
    stage = Stage(spec, cfg, store=None, dtype=torch.float32, rc_block=rc_block)
    saved = SavedTensors(stage.parameters())
    env = StageEnv(saved, Recorder(0, torch.device("cpu")), total_tokens=T)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(T, n, C, generator=gen)
    dy = torch.randn(T, n, C, generator=gen)  # random upstream grad, never all-ones
    run = ChunkRun(1, 0)
    before = saved.live
    forward, backward = StorageTracker(), StorageTracker()
    with forward:
        for _ in stage.forward_steps(run, x, None, env):
            pass
    held = saved.live - before
    held_outside = sum(forward.live(exclude=[run.output]).values())  # what the forward left for the backward
    out = run.output.clone()
    with backward:
        for _ in stage.backward_steps(run, dy, env):
            pass
    grads = {k: p.grad.clone() for k, p in stage.named_parameters()}
    keep = [run.output, run.input_grad] + [p.grad for p in stage.parameters()]
    leaked = {**forward.live(exclude=keep), **backward.live(exclude=keep)}
    return held, held_outside, leaked, out, run.input_grad, grads, saved


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("lr", [1, 3, 8])
def test_recompute_is_bitwise_and_saves_table3_memory(n, lr):
    off_bytes, off_outside, off_leaked, out0, dx0, g0, _ = _run_stage(n, None)
    on_bytes, on_outside, on_leaked, out1, dx1, g1, saved = _run_stage(n, lr)
    assert torch.equal(out0, out1) and torch.equal(dx0, dx1)
    assert all(torch.equal(g0[k], g1[k]) for k in g0), "recompute changed a gradient"
    assert saved.live == 0, "saved activations leaked after backward (the runtime's counter)"
    for what, leaked in (("without", off_leaked), ("with", on_leaked)):
        assert not leaked, (f"{what} recompute, {len(leaked)} storages ({sum(leaked.values())} bytes) made by the "
                            "stage's forward or backward are still alive after its backward")
    sub = 2 * BLOCKS
    nblocks = math.ceil(sub / lr)
    if n > 1:
        # Table 3 per sub-layer and token: (n+3)C without recompute (x_l, H_pre x_l, its norm, F's output);
        # with it C per sub-layer (F's output) plus nC per block (x_l0).
        predicted = (sub * (n + 3) - (sub + n * nblocks)) * C * 4 * T
    else:
        # the plain residual keeps x_l (C, the same storage as its F input) and the norm output: 2C; recompute
        # keeps F's output (C) and x_l0 per block.
        predicted = (sub * 2 - (sub + nblocks)) * C * 4 * T
    assert off_bytes - on_bytes == predicted, ("the runtime's counter", off_bytes, on_bytes, predicted)
    assert off_outside - on_outside == predicted, ("storages alive after the forward", off_outside, on_outside,
                                                   predicted)


def test_runtime_cuts_each_stage_by_eq20_over_its_own_sublayers():
    """2 stages of 8 blocks: Eq. 20 over a stage's 8 sub-layers gives 2 (over the model's 16 it would be 4)."""
    cfg = parse_config(tiny_config("1f1b", 2, n=4, blocks=8, recompute={"mode": "auto"}))
    rt = RankRuntime(cfg, 0, torch.device("cpu"), record=False)
    assert eq20_block_size(8, 4) == 2 and eq20_block_size(16, 4) == 4
    for stage in rt.stages.values():
        assert [len(g) for g in stage.groups] == [2, 2, 2, 2], stage.spec
    assert rt.rc_block == 2
