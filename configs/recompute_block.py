"""The recompute block length L_r (mhc.md Eq. 20), shared by the runtime (pipeline.runtime.recompute) and the cost
model (costmodel.physics.memory) so both cut a stage into the same blocks.

Eq. 20, per token in units of C, for a stage of L sub-layers and n residual streams:
    L_r* = argmin_{1 <= L_r <= L} [ n ceil(L / L_r) + (n+2) L_r ]
the first term the block inputs kept for every block, the second the transient intermediates of the one block
whose backward runs. Ties go to the smaller block. Blocks never cross a stage boundary (mhc.md §5).
"""
from __future__ import annotations

import math

from .models import RecomputeConfig


def eq20_objective(n: int, L: int, L_r: int) -> int:
    """Eq. 20's objective in units of C per token: resident block inputs + transient active block."""
    return n * math.ceil(L / L_r) + (n + 2) * L_r


def eq20_block_size(L: int, n: int) -> int:
    """L_r* minimising Eq. 20 over 1..L (ties: the smaller block). L = sub-layers on the stage."""
    if L < 1:
        raise ValueError(f"a stage needs at least one sub-layer, got L={L}")
    return min(range(1, L + 1), key=lambda r: (eq20_objective(n, L, r), r))


def recompute_block_size(recompute: RecomputeConfig, L: int, n: int) -> int | None:
    """Sub-layers per recompute block for a stage of L sub-layers: None when recompute is off, the configured
    block_size in mode 'block' (as configured: it may exceed L, which then makes one block of the whole stage),
    Eq. 20 in mode 'auto'."""
    if recompute.mode == "off":
        return None
    if recompute.mode == "block":
        return int(recompute.block_size)
    return eq20_block_size(L, n)
