"""A stage-boundary state of several tensors as one message: the streams and a user model's extra state parts
(pipeline.user_model.StatePart, e.g. a deferred fp32 term beside bf16 streams) packed into one byte buffer.

Why one buffer: the executor, the P2P channels, the strict transport and the CUDA device layer move one tensor per
(stage, micro-batch, direction), in a posting order every rank agrees on; one message per channel keeps that order
(two tensors per boundary would be two ops that each rank must post alike) and costs one NCCL launch. The
gradients travel back the same way: the gradient of each part, in the same layout.

Layout: the parts in order, each its bytes (contiguous, row-major), each starting at a multiple of 16 bytes, so that
every part read back is a correctly aligned view of the buffer (no copy on unpacking).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_ALIGN = 16


@dataclass(frozen=True)
class BoundaryLayout:
    """The parts (name, shape, dtype) of one boundary message, for T tokens."""

    parts: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]

    @classmethod
    def of(cls, parts, tokens: int) -> "BoundaryLayout":
        """From (name, shape per token, dtype) parts (UserModel.state_parts)."""
        return cls(tuple((name, (tokens, *shape), dtype) for name, shape, dtype in parts))

    @property
    def offsets(self) -> list[int]:
        out, off = [], 0
        for _, shape, dtype in self.parts:
            out.append(off)
            size = _numel(shape) * dtype.itemsize
            off += -(-size // _ALIGN) * _ALIGN
        return out

    @property
    def nbytes(self) -> int:
        _, shape, dtype = self.parts[-1]
        return self.offsets[-1] + _numel(shape) * dtype.itemsize

    def pack(self, state: tuple) -> torch.Tensor:
        """The parts of `state` (tensors; None: zeros, a gradient that does not reach a part) as one uint8 buffer."""
        device = next(t.device for t in state if t is not None)
        flat = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        for (name, shape, dtype), off, t in zip(self.parts, self.offsets, state):
            if t is None:
                continue
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"boundary part {name!r}: got {list(t.shape)} {t.dtype}, the layout has "
                                 f"{list(shape)} {dtype}")
            size = _numel(shape) * dtype.itemsize
            flat[off:off + size].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        return flat

    def unpack(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Views of `flat` (a buffer `pack` made), one per part."""
        if flat.dtype != torch.uint8 or flat.numel() != self.nbytes:
            raise ValueError(f"a boundary message of {flat.numel()} {flat.dtype} elements; the layout "
                             f"{[n for n, _, _ in self.parts]} takes {self.nbytes} bytes")
        out = []
        for (_, shape, dtype), off in zip(self.parts, self.offsets):
            size = _numel(shape) * dtype.itemsize
            out.append(flat[off:off + size].view(dtype).view(shape))
        return tuple(out)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
