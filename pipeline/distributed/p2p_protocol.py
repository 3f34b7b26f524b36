"""What the executor asks of its collaborators, as protocols: the P2P transport (pipeline.distributed.p2p.Transport
on gloo or NCCL, pipeline.distributed.loopback.LoopbackTransport for one rank alone, test doubles) and the gradient
reduction (pipeline.distributed.grad_reduce.GradReducer)."""
from __future__ import annotations

from typing import Protocol

import torch

from pipeline.distributed.comm import Handle


class P2PTransport(Protocol):
    def post(self, ops: list[tuple[bool, str, int, torch.Tensor]], labels=None) -> list[Handle]:
        """Post (is_send, name, peer pipeline rank, tensor) ops without waiting; one handle each."""

    def wait(self, h: Handle, deadline_s: float | None = None) -> torch.Tensor:
        """Block (CPU) or order the compute stream (CUDA) until `h` completed; the received or sent tensor."""

    def poll(self, h: Handle) -> bool:
        """Has `h` completed? Non-blocking."""


class GradSink(Protocol):
    """Where the executor reports each finished action, so that gradient reductions start as soon as a chunk's
    last backward work is done."""

    def action_done(self, action) -> None: ...
