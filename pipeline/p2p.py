"""P2P transport of the [T, n, C] residual and its gradient between pipeline ranks, asynchronous.

Shape letters: T tokens of a micro-batch, n streams, C hidden.

`Transport.post(ops)` issues one `batch_isend_irecv` for a group of SEND/RECV ops over the pipeline's process
group (the mesh's `pp` dimension; peers are pipeline ranks) and returns one `comm.Handle` per op without waiting.
Compute waits only on the receive it consumes and sends are reaped when they complete; waits, deadlines and
their spans are `comm.Comms`' business.

Backends: gloo on CPU, NCCL on CUDA. `staged=True` is the host-staged transport for several ranks sharing one
GPU (NCCL and gloo refuse that): device tensors are copied to host memory, sent with gloo, and received into
host buffers that are copied to the device after the wait.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from .comm import Comms, Handle, PipelineError, describe

__all__ = ["Transport", "PipelineError", "Pending", "init_distributed"]

Pending = Handle  # the name the executor and the loopback transport use for a P2P handle


class Transport:
    """Posts and waits P2P ops for one rank. `group`: the pipeline's process group (None = the default group,
    whose ranks are then the pipeline ranks)."""

    def __init__(self, rank: int, device: torch.device, comms: Comms, staged: bool = False, group=None):
        self.rank = rank  # this rank's pipeline rank (peers are pipeline ranks); messages name the global rank
        self.device = device
        self.comms = comms
        self.staged = staged
        self.group = group
        self._global: dict[int, int] = {}

    @property
    def timeout_s(self) -> float:
        return self.comms.timeout_s

    def _peer(self, peer: int) -> int:
        """The global rank of pipeline rank `peer` (looked up once per peer)."""
        g = self._global.get(peer)
        if g is None:
            g = self._global[peer] = peer if self.group is None else dist.get_global_rank(self.group, peer)
        return g

    def post(self, ops: list[tuple[bool, str, int, torch.Tensor]], labels=None) -> list[Handle]:
        """ops: (is_send, name, peer, tensor) - for a receive, `tensor` is the buffer to fill. `labels`: the
        (kind, stage, mb) of each op for its span (default: parsed from nothing, no span stage)."""
        handles, p2p = [], []
        for i, (is_send, name, peer, tensor) in enumerate(ops):
            _, stage, mb = labels[i] if labels is not None else (None, None, None)
            to = self._peer(peer)
            if is_send:
                wire = tensor.detach().to("cpu", copy=True) if self.staged else tensor.detach().contiguous()
                op = dist.P2POp(dist.isend, wire, to, self.group)
            else:
                wire = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu") if self.staged else tensor
                op = dist.P2POp(dist.irecv, wire, to, self.group)
            h = Handle(is_send, name, to, stage, mb, tensor, wire)  # messages name the global rank
            handles.append(h)
            p2p.append(op)
        if not p2p:
            return handles
        spans = [(name.split("/", 1)[0], h.stage, h.mb, peer, f"{name}~comm")
                 for (_, name, peer, _), h in zip(ops, handles)]
        try:
            works, tokens = self.comms.launch(lambda: dist.batch_isend_irecv(p2p), spans)
        except Exception as err:  # noqa: BLE001 - backend errors have no common type
            names = ", ".join(f"{h.name} {'to' if h.is_send else 'from'} rank {h.peer}" for h in handles)
            raise PipelineError(f"rank {self.comms.rank}: posting {names} failed: {describe(err)}") from None
        if len(works) == 1 and len(handles) > 1:  # NCCL coalesces a batch into one work: every op completes with it
            works = works * len(handles)
        if len(works) != len(handles):
            raise PipelineError(f"rank {self.comms.rank}: the backend returned {len(works)} works for {len(handles)} "
                                "P2P ops")
        for h, w, token in zip(handles, works, tokens):
            h.work, h.token = w, token
            self.comms.track(h, p2p=True)
        return handles

    def wait(self, h: Handle, deadline_s: float | None = None) -> torch.Tensor:
        """Block until `h` completes (at most the timeout); returns the received/sent device tensor."""
        if not h.done:
            self.comms.wait(h, deadline_s)
            if self.staged and not h.is_send:
                h.tensor.copy_(h.wire, non_blocking=False)
        return h.tensor

    def poll(self, h: Handle) -> bool:
        """Non-blocking: has `h` completed?"""
        if h.done:
            return True
        if self.comms.poll(h):
            if self.staged and not h.is_send:
                h.tensor.copy_(h.wire, non_blocking=False)
            return True
        return False


def init_distributed(backend: str, timeout_s: float) -> None:
    """init_process_group from torchrun's environment with a bounded timeout for every collective."""
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as err:  # noqa: BLE001
        raise PipelineError(f"could not join the process group ({backend}): {describe(err)}") from None
