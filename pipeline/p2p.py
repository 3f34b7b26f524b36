"""P2P transport of the [T, n, C] residual and its gradient, asynchronous, with a deadline on every wait.

Shape letters: T tokens of a micro-batch, n streams, C hidden.

`Transport.post(ops)` issues one `batch_isend_irecv` for a group of consecutive SEND/RECV actions of the
lowered schedule (receives are posted one compute action ahead of their consumer, sends right after their
producer; schedules/lowering.py); it returns one `Pending` per op and never waits. Compute waits only on the
receive it consumes (`wait`), and sends are reaped when they complete (`poll`) or at the end of the step.

Every wait has a deadline: `Work.wait(timeout)` where the backend supports it (gloo does), otherwise a poll
of `is_completed()` until the deadline. Failures become a `PipelineError` naming the rank, the op (trace
name, e.g. RECV_F/s1/mb3) and the peer: a timeout, or a peer that closed its connection (it died).

Backends: gloo on CPU, NCCL on CUDA. `staged=True` is the host-staged transport for several ranks sharing one
GPU (NCCL and gloo refuse that): device tensors are copied to host memory, sent with gloo, and received into
host buffers that are copied to the device after the wait.
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class PipelineError(RuntimeError):
    """A distributed failure with a one-line, user-facing message (rank, op, peer, cause)."""


@dataclass
class Pending:
    is_send: bool
    name: str  # trace name, e.g. SEND_F/s3/mb7
    peer: int
    tensor: torch.Tensor  # the device tensor sent, or the buffer the receive will deliver
    wire: torch.Tensor  # what the backend actually reads/writes (host copy when staged)
    work: object | None = None
    posted_at: float = field(default_factory=time.monotonic)
    token: object = None  # recorder handle
    done: bool = False


def _describe(err: BaseException) -> str:
    text = str(err)
    if "Connection closed by peer" in text or "Connection reset" in text or "Broken pipe" in text:
        return "the peer closed its connection (it probably died)"
    if "Timed out" in text or "timed out" in text or "Timeout" in text:
        return "the backend timed out"
    return text.splitlines()[0][:200] if text else type(err).__name__


class Transport:
    """Posts and waits P2P ops for one rank. `group` None = the default process group."""

    def __init__(self, rank: int, device: torch.device, timeout_s: float, staged: bool = False, group=None):
        self.rank = rank
        self.device = device
        self.timeout_s = float(timeout_s)
        self.staged = staged
        self.group = group

    def _peer(self, peer: int) -> int:
        return peer if self.group is None else dist.get_global_rank(self.group, peer)

    def post(self, ops: list[tuple[bool, str, int, torch.Tensor]]) -> list[Pending]:
        """ops: (is_send, name, peer, tensor) - for a receive, `tensor` is the buffer to fill."""
        pendings, p2p = [], []
        for is_send, name, peer, tensor in ops:
            if is_send:
                wire = tensor.detach().to("cpu", copy=True) if self.staged else tensor.detach().contiguous()
                op = dist.P2POp(dist.isend, wire, self._peer(peer), self.group)
            else:
                wire = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu") if self.staged else tensor
                op = dist.P2POp(dist.irecv, wire, self._peer(peer), self.group)
            pendings.append(Pending(is_send, name, peer, tensor, wire))
            p2p.append(op)
        if not p2p:
            return pendings
        try:
            works = dist.batch_isend_irecv(p2p)
        except Exception as err:  # noqa: BLE001 - backend errors have no common type
            names = ", ".join(p.name for p in pendings)
            raise PipelineError(f"rank {self.rank}: posting {names} failed: {_describe(err)}") from None
        for p, w in zip(pendings, works):
            p.work = w
        return pendings

    def wait(self, p: Pending, deadline_s: float | None = None) -> torch.Tensor:
        """Block until `p` completes (at most the timeout); returns the received/sent device tensor."""
        if p.done:
            return p.tensor
        limit = self.timeout_s if deadline_s is None else deadline_s
        direction = "to" if p.is_send else "from"
        started = time.monotonic()
        try:
            ok = self._wait_work(p.work, limit)
        except PipelineError:
            raise
        except Exception as err:  # noqa: BLE001
            cause = _describe(err)
            if cause == "the backend timed out":
                raise PipelineError(f"rank {self.rank}: timed out after {limit:g} s waiting for {p.name} "
                                    f"{direction} rank {p.peer}") from None
            raise PipelineError(f"rank {self.rank}: {p.name} {direction} rank {p.peer} failed after "
                                f"{time.monotonic() - started:.1f} s: {cause}") from None
        if not ok:
            raise PipelineError(f"rank {self.rank}: timed out after {limit:g} s waiting for {p.name} "
                                f"{direction} rank {p.peer}")
        if self.staged and not p.is_send:
            p.tensor.copy_(p.wire, non_blocking=False)
        p.done = True
        return p.tensor

    def _wait_work(self, work, limit: float) -> bool:
        try:
            return work.wait(datetime.timedelta(seconds=limit)) is not False
        except (TypeError, NotImplementedError):
            pass  # backend without a timed wait: poll
        deadline = time.monotonic() + limit
        pause = 1e-5
        while not work.is_completed():
            if time.monotonic() > deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        work.wait()
        return True

    def poll(self, p: Pending) -> bool:
        """Non-blocking: has `p` completed? Errors surface as PipelineError."""
        if p.done:
            return True
        try:
            finished = p.work.is_completed()
        except Exception as err:  # noqa: BLE001
            raise PipelineError(f"rank {self.rank}: {p.name} to rank {p.peer} failed: {_describe(err)}") from None
        if finished:
            self.wait(p)
        return finished


def init_distributed(backend: str, timeout_s: float) -> None:
    """init_process_group from torchrun's environment with a bounded timeout for every collective."""
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as err:  # noqa: BLE001
        raise PipelineError(f"could not join the process group ({backend}): {_describe(err)}") from None


def collective(fn, *args, what: str, rank: int, timeout_s: float, **kwargs):
    """Run an async collective and wait for it with the deadline; one-line errors."""
    try:
        work = fn(*args, async_op=True, **kwargs)
        work.wait(datetime.timedelta(seconds=timeout_s))
    except Exception as err:  # noqa: BLE001
        cause = _describe(err)
        if cause == "the backend timed out":
            raise PipelineError(f"rank {rank}: timed out after {timeout_s:g} s in {what}") from None
        raise PipelineError(f"rank {rank}: {what} failed: {cause}") from None
