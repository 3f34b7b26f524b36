"""mHC recompute (mhc.md §5, paper §4.3.2): drop a block's mHC intermediates after F, rebuild them for B.

Shape letters: T tokens, n streams, C hidden, L sub-layers, L_r recompute block length (sub-layers).

Within a recompute block of L_r consecutive sub-layers of one stage, the forward keeps (Table 3): the block
input x_l0 [T, n, C], every sub-layer output F(H_pre x_l) [T, C] and the coefficients (fp32, light). It does
not keep x_l (l > l0), H_pre x_l and RMSNorm(H_pre x_l): while the block's forward runs, a saved-tensor pack
hook replaces any tensor that autograd wants to save and whose storage is one of those by a small token
(which tensor, and the view's size/stride/offset). Before the block's backward, `rebuild()` runs only the mHC
kernels, x_{l+1} = post_res(x_l, y_l, coeffs_l), u_l = pre(x_l, coeffs_l), h_l = norm(u_l), from x_l0 and the
stored y and coefficients - never attention or the MLP - with the very functions the forward ran, so the
rebuilt tensors are bitwise the forward's. The unpack hook then serves tokens from that cache; `release()`
drops it after the block's backward, so only one block's intermediates are transient at a time.

Blocks never cross a stage boundary. Block length: `configs.recompute_block_size` (mode 'block': the
configured size; 'auto': Eq. 20 over the stage's sub-layers), the one rule the cost model prices too;
`split_blocks` cuts a stage's sub-layers into blocks of that length.
"""
from __future__ import annotations

from typing import Callable

import torch

Token = tuple[str, int, tuple[int, ...], tuple[int, ...], int]  # (what, sub-layer, size, stride, offset)


def split_blocks(sublayers: list, size: int | None, unit: int = 2) -> list[list]:
    """Cut a stage's ordered sub-layers into segments: recompute blocks of `size` (the last may be shorter),
    or, with recompute off, `unit` sub-layers (one Transformer block) per segment."""
    step = size if size is not None else unit
    return [sublayers[i:i + step] for i in range(0, len(sublayers), step)]


def _storage_key(t: torch.Tensor) -> int:
    """Base address of t's storage, without building a storage object (this runs for every saved tensor)."""
    return t.data_ptr() - t.storage_offset() * t.element_size()


class RecomputeBlock:
    """One recompute block of one (stage, micro-batch): the forward's record and the backward's cache.

    `register(t, what, i)` marks a tensor as droppable; `keep(t)` marks a storage that must stay (the block
    input). `record(i, piece)` stores what the rebuild needs for sub-layer i: a callable that maps x_i to
    (u_i, h_i, x_{i+1}) under no_grad using the stored y_i and coefficients.
    """

    def __init__(self, x0: torch.Tensor, first_layer: int = 0):
        self.x0 = x0
        self.first_layer = first_layer  # global sub-layer index of the block's first sub-layer
        self._kept = {_storage_key(x0)}
        self._droppable: dict[int, tuple[str, int]] = {}
        self._live: list[torch.Tensor] = []  # forward-time references (stop storage reuse while hooks run)
        self._steps: list[Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []
        self._cache: dict[tuple[str, int], torch.Tensor] | None = None
        self._held: list[object] = []
        self.num_rebuilds = 0

    # -- forward ------------------------------------------------------------------------------------------
    def register(self, t: torch.Tensor, what: str, index: int) -> None:
        key = _storage_key(t)
        if key in self._kept or key in self._droppable:
            return  # a view of something already known (e.g. x[:, 0] of the 'residual' variant)
        self._droppable[key] = (what, index)
        self._live.append(t)

    def record(self, step: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
               held: object = None) -> None:
        """`held`: the accounting handle of what `step` keeps (released with the block)."""
        self._steps.append(step)
        if held is not None:
            self._held.append(held)

    def end_forward(self) -> None:
        """Forward of the block done: drop the forward-time references; only tokens remain in the graph."""
        self._live.clear()

    def pack(self, t: torch.Tensor) -> Token | None:
        """A token for a droppable tensor, None for anything that must really be saved."""
        hit = self._droppable.get(_storage_key(t)) if t.device.type != "meta" else None
        if hit is None:
            return None
        return (hit[0], hit[1], tuple(t.shape), tuple(t.stride()), t.storage_offset())

    # -- backward -----------------------------------------------------------------------------------------
    def rebuild(self) -> None:
        """Re-run the block's mHC kernels (not F) from x_l0 and the stored F outputs and coefficients."""
        if self._cache is not None:
            return
        cache: dict[tuple[str, int], torch.Tensor] = {}
        with torch.no_grad():
            x = self.x0.detach()
            for i, step in enumerate(self._steps):
                if i > 0:
                    cache[("x", i)] = x
                u, h, x = step(x)
                cache[("u", i)] = u
                cache[("h", i)] = h
        self._cache = cache
        self.num_rebuilds += 1

    def unpack(self, token: Token) -> torch.Tensor:
        if self._cache is None:
            self.rebuild()
        what, index, size, stride, offset = token
        base = self._cache.get((what, index))
        if base is None:
            raise RuntimeError(f"recompute: no rebuilt tensor {what}_{index}; the block's record is inconsistent")
        return base.as_strided(size, stride, offset)

    def release(self) -> None:
        self._cache = None

    def cache_bytes(self) -> int:
        if not self._cache:
            return 0
        seen: dict[int, int] = {}
        for t in self._cache.values():
            seen[_storage_key(t)] = t.untyped_storage().nbytes()
        return sum(seen.values())
