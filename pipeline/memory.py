"""Activation memory: bytes of tensors saved for backward, live and peak, per rank.

Every forward segment (pipeline.stage) runs under `SavedTensors.hooks(block)`, one
`torch.autograd.graph.saved_tensors_hooks` pair that (1) asks the active recompute block (if any) whether the
tensor is droppable and then stores only a token, and (2) otherwise notes the tensor's storage in the segment's
`Held` set, counting each storage once per rank however many views of it are saved. Parameters (and views of
them, e.g. W^T) are not activations and are not counted. A segment's storages are released when its backward
has run (`release`), not tensor by tensor: a per-tensor finalizer costs a Python object and callback for every
saved tensor (thousands per step: 20 unrolled Sinkhorn rounds each save theirs), which made the hooks a quarter
of an mHC step on CPU. Within one segment's backward that counts its tensors a little longer than autograd
keeps them; peaks, which come at the end of forwards, are unchanged. On CUDA the same numbers sit next to
torch.cuda.max_memory_allocated.

Storage identity without building a storage object per tensor: the storage's base address is
data_ptr - storage_offset * element_size.

Counting is instrumentation, like the trace recorder: a runtime counts when it records (`counting=True`);
otherwise the hooks run only inside recompute blocks, which need them to drop tensors, and `peak` stays 0.
"""
from __future__ import annotations

import contextlib

import torch

from .recompute import RecomputeBlock


class Held:
    """The storages one forward segment saved (base address -> counted)."""

    __slots__ = ("keys",)

    def __init__(self):
        self.keys: set[int] = set()


class _HeldTensor:
    """A tensor kept for backward outside autograd (a recompute block's stored F output), counted until freed."""

    __slots__ = ("tensor", "key", "owner")

    def __init__(self, tensor: torch.Tensor, key: int | None, owner: "SavedTensors"):
        self.tensor, self.key, self.owner = tensor, key, owner

    def __del__(self):
        if self.key is not None:
            self.owner._release_key(self.key)


def _storage_key(t: torch.Tensor) -> int:
    return t.data_ptr() - t.storage_offset() * t.element_size()


class SavedTensors:
    """Live and peak bytes of saved activations on this rank."""

    def __init__(self, params=(), counting: bool = True):
        self.counting = counting
        self._param_keys = {_storage_key(p) for p in params}
        self._refs: dict[int, list[int]] = {}  # storage key -> [holders (segments, held tensors), nbytes]
        self.live = 0
        self.peak = 0

    def reset_peak(self) -> None:
        self.peak = self.live

    def note_transient(self, nbytes: int) -> None:
        """A recompute block's rebuilt intermediates exist on top of the live saved bytes until released."""
        self.peak = max(self.peak, self.live + nbytes)

    def hold(self, t: torch.Tensor) -> _HeldTensor:
        """Count a tensor kept for backward outside autograd (a recompute block's stored F output)."""
        key = _storage_key(t)
        if not self.counting or key in self._param_keys or key == 0:
            return _HeldTensor(t, None, self)
        self._acquire(key, t)
        return _HeldTensor(t, key, self)

    def _acquire(self, key: int, t: torch.Tensor) -> None:
        entry = self._refs.get(key)
        if entry is None:
            nbytes = t.untyped_storage().nbytes()
            self._refs[key] = [1, nbytes]
            self.live += nbytes
            if self.live > self.peak:
                self.peak = self.live
        else:
            entry[0] += 1

    def _release_key(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._refs[key]

    def release(self, held: Held | None) -> None:
        """A segment's backward has run: its saved storages no longer count."""
        if held is None:
            return
        for key in held.keys:
            self._release_key(key)
        held.keys.clear()

    @contextlib.contextmanager
    def hooks(self, block: RecomputeBlock | None = None):
        """Yields the segment's `Held` (None when not counting); pass it to `release` after the segment's
        backward."""
        if not self.counting:
            if block is None:
                yield None
                return
            with torch.autograd.graph.saved_tensors_hooks(*_recompute_hooks(block)):
                yield None
            return
        held = Held()
        keys, skip, acquire = held.keys, self._param_keys, self._acquire

        def pack(t: torch.Tensor):
            if block is not None:
                token = block.pack(t)
                if token is not None:
                    return ("rc", block, token)
            key = t.data_ptr() - t.storage_offset() * t.element_size()
            if key not in keys and key not in skip and key != 0:
                keys.add(key)
                acquire(key, t)
            # Detached: a saved *output* kept with its grad_fn would form a cycle node -> tensor -> node that is
            # never freed (the engine avoids it for its own saved outputs; hooks must do it themselves).
            return t.detach()

        def unpack(packed):
            if type(packed) is tuple:
                return packed[1].unpack(packed[2])
            return packed

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield held


def _recompute_hooks(block: RecomputeBlock):
    """Pack/unpack that only drop (and later rebuild) a recompute block's intermediates; nothing is counted."""

    def pack(t: torch.Tensor):
        token = block.pack(t)
        return ("rc", block, token) if token is not None else t.detach()

    def unpack(packed):
        if type(packed) is tuple:
            return packed[1].unpack(packed[2])
        return packed

    return pack, unpack
