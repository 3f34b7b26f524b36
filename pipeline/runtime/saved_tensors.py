"""Activation memory: bytes of tensors saved for backward, live and peak, per rank.

Every forward segment (pipeline.runtime.stage) runs under `SavedTensors.hooks(block)`, one
`torch.autograd.graph.saved_tensors_hooks` pair that (1) asks the active recompute block (if any) whether the
tensor is droppable and then stores only a token, and (2) otherwise, when counting, wraps the tensor in a holder
that counts its storage once (views of one storage share one count) until autograd frees it. Parameters (and
views of them, e.g. W^T) are not activations and are not counted. On CUDA the same numbers sit next to
torch.cuda.max_memory_allocated.

Counting is instrumentation, like the trace recorder: it costs a Python object and callback for every saved
tensor (thousands per step: each of the unrolled Sinkhorn rounds saves its own). A runtime counts when it
records (`counting=True`); otherwise the hooks run only inside recompute blocks, which need them to drop
tensors, and `peak` stays 0. Storage identity without building a storage object per tensor: the storage's
base address is data_ptr - storage_offset * element_size.
"""
from __future__ import annotations

import contextlib

import torch

from pipeline.runtime.recompute import RecomputeBlock


class _Held:
    """A saved tensor (or one kept for backward outside autograd), counted until it is freed."""

    __slots__ = ("tensor", "key", "owner")

    def __init__(self, tensor: torch.Tensor, key: int | None, owner: "SavedTensors"):
        self.tensor, self.key, self.owner = tensor, key, owner

    def __del__(self):
        if self.key is not None:
            self.owner._release(self.key)


def _storage_key(t: torch.Tensor) -> int:
    return t.data_ptr() - t.storage_offset() * t.element_size()


class SavedTensors:
    """Live and peak bytes of saved activations on this rank."""

    def __init__(self, params=(), counting: bool = True):
        self.counting = counting
        self._param_keys = {_storage_key(p) for p in params}
        self._refs: dict[int, list[int]] = {}  # storage key -> [holders, nbytes]
        self.live = 0
        self.peak = 0

    def reset_peak(self) -> None:
        self.peak = self.live

    def note_transient(self, nbytes: int) -> None:
        """A recompute block's rebuilt intermediates exist on top of the live saved bytes until released."""
        if self.counting:
            self.peak = max(self.peak, self.live + nbytes)

    def hold(self, t: torch.Tensor) -> _Held:
        """Count a tensor kept for backward outside autograd (a recompute block's stored F output)."""
        return _Held(t, self._acquire(t) if self.counting else None, self)

    def _acquire(self, t: torch.Tensor) -> int | None:
        key = t.data_ptr() - t.storage_offset() * t.element_size()
        if key in self._param_keys or key == 0:
            return None
        entry = self._refs.get(key)
        if entry is None:
            nbytes = t.untyped_storage().nbytes()
            self._refs[key] = [1, nbytes]
            self.live += nbytes
            if self.live > self.peak:
                self.peak = self.live
        else:
            entry[0] += 1
        return key

    def _release(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._refs[key]

    @contextlib.contextmanager
    def hooks(self, block: RecomputeBlock | None = None):
        if not self.counting and block is None:
            yield
            return
        counting, acquire = self.counting, self._acquire

        def pack(t: torch.Tensor):
            if block is not None:
                token = block.pack(t)
                if token is not None:
                    return ("rc", block, token)
            # Detached: a saved *output* held with its grad_fn would form a cycle node -> holder -> tensor -> node
            # that is never freed (the engine avoids it for its own saved outputs; hooks must do it themselves).
            return _Held(t.detach(), acquire(t), self) if counting else t.detach()

        def unpack(packed):
            if type(packed) is tuple:
                return packed[1].unpack(packed[2])
            return packed.tensor if type(packed) is _Held else packed

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
