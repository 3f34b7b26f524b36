"""Activation memory: bytes of tensors saved for backward, live and peak, per rank.

Every forward segment runs under `SavedTensors.hooks(block)`, one `torch.autograd.graph.saved_tensors_hooks`
pair that (1) asks the active recompute block (if any) whether the tensor is droppable and then stores only a
token, and (2) otherwise wraps the tensor in a holder that counts its storage once (views of one storage share
one count) until autograd frees the graph node. Parameters (and views of them, e.g. W^T) are not activations
and are not counted. On CUDA the same numbers sit next to torch.cuda.max_memory_allocated.
"""
from __future__ import annotations

import contextlib

import torch

from .recompute import RecomputeBlock


class _Held:
    __slots__ = ("tensor", "key", "owner")

    def __init__(self, tensor: torch.Tensor, key: int | None, owner: "SavedTensors"):
        self.tensor, self.key, self.owner = tensor, key, owner

    def __del__(self):
        if self.key is not None:
            self.owner._release(self.key)


class SavedTensors:
    """Live and peak bytes of saved activations on this rank."""

    def __init__(self, params=()):
        self._param_keys = {p.untyped_storage().data_ptr() for p in params}
        self._refs: dict[int, list[int]] = {}  # storage key -> [refcount, nbytes]
        self.live = 0
        self.peak = 0

    def reset_peak(self) -> None:
        self.peak = self.live

    def note_transient(self, nbytes: int) -> None:
        """A recompute block's rebuilt intermediates exist on top of the live saved bytes until released."""
        self.peak = max(self.peak, self.live + nbytes)

    def hold(self, t: torch.Tensor) -> _Held:
        """Count a tensor kept for backward outside autograd (a recompute block's stored F output)."""
        return _Held(t, self._acquire(t), self)

    def _acquire(self, t: torch.Tensor) -> int | None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._param_keys or key == 0:
            return None
        entry = self._refs.get(key)
        if entry is None:
            self._refs[key] = [1, storage.nbytes()]
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
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
        def pack(t: torch.Tensor):
            if block is not None:
                token = block.pack(t)
                if token is not None:
                    return ("rc", block, token)
            # Detached: a saved *output* held with its grad_fn would form a cycle node -> holder -> tensor -> node
            # that is never freed (the engine avoids it for its own saved outputs; hooks must do it themselves).
            return _Held(t.detach(), self._acquire(t), self)

        def unpack(packed):
            if isinstance(packed, _Held):
                return packed.tensor
            _, blk, token = packed
            return blk.unpack(token)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
