"""mHC recompute: bitwise-equal gradients, the memory Table 3 predicts, Eq. 20 block sizes."""
from __future__ import annotations

import math

import pytest
import torch

from _pipeline_helpers import tiny_config
from configs import parse_config
from pipeline.memory import SavedTensors
from pipeline.partition import StageSpec
from pipeline.recompute import eq20_block_size
from pipeline.recorder import Recorder
from pipeline.stage import ChunkRun, Stage, StageEnv

T, C, BLOCKS = 32, 32, 4  # tokens, hidden, blocks of the middle stage (8 sub-layers)


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
    for _ in stage.forward_steps(run, x, None, env):
        pass
    held = saved.live - before
    out = run.output.clone()
    for _ in stage.backward_steps(run, dy, env):
        pass
    grads = {k: p.grad.clone() for k, p in stage.named_parameters()}
    return held, out, run.input_grad, grads, saved


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("lr", [1, 3, 8])
def test_recompute_is_bitwise_and_saves_table3_memory(n, lr):
    off_bytes, out0, dx0, g0, _ = _run_stage(n, None)
    on_bytes, out1, dx1, g1, saved = _run_stage(n, lr)
    assert torch.equal(out0, out1) and torch.equal(dx0, dx1)
    assert all(torch.equal(g0[k], g1[k]) for k in g0), "recompute changed a gradient"
    assert saved.live == 0, "saved activations leaked after backward"
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
    assert off_bytes - on_bytes == predicted, (off_bytes, on_bytes, predicted)


def test_eq20_block_size():
    # n*ceil(L/L_r) + (n+2)*L_r; n = 4: about sqrt(2L/3)
    assert eq20_block_size(16, 4) == 4
    assert eq20_block_size(60, 4) in (6, 7)
    for L in (8, 24, 60, 122):
        best = eq20_block_size(L, 4)
        cost = lambda r: 4 * math.ceil(L / r) + 6 * r  # noqa: E731
        assert all(cost(best) <= cost(r) for r in range(1, L + 1))
