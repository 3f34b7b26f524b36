"""Loopback transport: one rank's action list run alone, every stage boundary replaced by a local hand-off.

Shape letters: T tokens of a micro-batch, n streams, C hidden.

Same interface as `p2p.Transport` (post / wait / poll, returning `Pending`), so the executor runs the rank's
exact lowered action list unchanged. A SEND completes at once (its tensor is dropped, as a peer would consume
it). A RECV is filled, when it is posted, with a device copy of a pre-made random tensor of the boundary
shape: the activation [T, n, C] for RECV_F, the output-grad for RECV_B. The copy lands in the executor's own
receive buffer, so every micro-batch gets its own storage, as a real receive gives it. No process group is
needed. Used by bench/stage_bench.py to time a rank's compute without P2P waits (a stage-level benchmark on one GPU).
"""
from __future__ import annotations

import torch

from pipeline.distributed.p2p import Pending


class LoopbackTransport:
    """Completes sends at once and fills receives from pre-made tensors (one per direction)."""

    def __init__(self, rank: int, device: torch.device, shape: tuple[int, int, int], dtype: torch.dtype,
                 seed: int = 0, grad_scale: float = 1e-2):
        self.rank, self.device = rank, device
        gen = torch.Generator(device="cpu").manual_seed(seed)
        # Random, never zeros (gpu.md §7): zeros run faster and hide unwritten outputs.
        self.activation = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
        self.grad = (torch.randn(shape, generator=gen) * grad_scale).to(device=device, dtype=dtype)
        self.sends = 0
        self.recvs = 0

    def post(self, ops: list[tuple[bool, str, int, torch.Tensor]], labels=None) -> list[Pending]:
        """ops: (is_send, name, peer, tensor); names start with the action kind (SEND_F/, RECV_B/, ...)."""
        out = []
        for is_send, name, peer, tensor in ops:
            if is_send:
                self.sends += 1
                out.append(Pending(True, name, peer, tensor=tensor, wire=tensor, done=True))
                continue
            kind = name.split("/", 1)[0]
            if kind == "RECV_F":
                src = self.activation
            elif kind == "RECV_B":
                src = self.grad
            else:
                raise ValueError(f"loopback transport: cannot tell what receive {name!r} carries "
                                 "(expected a RECV_F/... or RECV_B/... name)")
            if tuple(tensor.shape) != tuple(src.shape) or tensor.dtype != src.dtype:
                raise ValueError(f"loopback transport: {name} buffer is {tuple(tensor.shape)} {tensor.dtype}, "
                                 f"the pre-made tensor {tuple(src.shape)} {src.dtype}; build the transport with "
                                 "the executor's boundary_shape and dtype")
            tensor.copy_(src)
            self.recvs += 1
            out.append(Pending(False, name, peer, tensor=tensor, wire=tensor, done=True))
        return out

    def wait(self, p: Pending, deadline_s: float | None = None) -> torch.Tensor:
        return p.tensor

    def poll(self, p: Pending) -> bool:
        return True
