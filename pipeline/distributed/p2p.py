"""P2P transport of the [T, n, C] residual and its gradient between pipeline ranks, asynchronous.

Shape letters: T tokens of a micro-batch, n streams, C hidden.

`Transport.post(ops)` issues the SEND/RECV ops (peers are pipeline ranks) as one `batch_isend_irecv` per P2P
channel group (pipeline.distributed.layout: one two-rank group per direction of each pipeline link, so a communicator
carries one channel's messages in one order on both ends: docs/communication.md) and returns one `comm.Handle` per op
without waiting.
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

from pipeline.distributed.comm import Comms, Handle
from pipeline.distributed.errors import PipelineError, describe

__all__ = ["Transport", "Pending", "init_distributed"]

Pending = Handle  # the name the executor and the loopback transport use for a P2P handle


class Transport:
    """Posts and waits P2P ops for one rank. `groups`: its `layout.ParallelGroups` (the P2P channel groups and
    their names); None = the default group, whose ranks are then the pipeline ranks. `strict`: a
    `strict_transport.StrictTransport` that runs the batches under NCCL's rules instead of posting them to gloo."""

    def __init__(self, rank: int, device: torch.device, comms: Comms, staged: bool = False, groups=None,
                 strict=None):
        self.rank = rank  # this rank's pipeline rank (peers are pipeline ranks); messages name the global rank
        self.device = device
        self.comms = comms
        self.staged = staged
        self.groups = groups
        self.strict = strict
        self._global: dict[int, int] = {}
        self._channels: dict[tuple[int, int], tuple[object, str]] = {}

    @property
    def timeout_s(self) -> float:
        return self.comms.timeout_s

    def _peer(self, peer: int) -> int:
        """The global rank of pipeline rank `peer` (looked up once per peer)."""
        g = self._global.get(peer)
        if g is None:  # this rank's pipeline row of the layout
            g = self._global[peer] = peer if self.groups is None else self.groups.layout.rank(peer,
                                                                                            self.groups.dp_rank)
        return g

    def _channel(self, src: int, dst: int) -> tuple[object, str]:
        """(process group, name) carrying pipeline rank src -> dst (looked up once per channel)."""
        ch = self._channels.get((src, dst))
        if ch is None:
            if self.groups is None:
                ch = (None, "world")
            else:
                group = self.groups.channel(src, dst)
                ch = (group, self.groups.name_of(group))
            self._channels[(src, dst)] = ch
        return ch

    def post(self, ops: list[tuple[bool, str, int, torch.Tensor]], labels=None) -> list[Handle]:
        """ops: (is_send, name, peer, tensor) - for a receive, `tensor` is the buffer to fill. `labels`: the
        (kind, stage, mb) of each op for its span. The ops go out as one batch per process group (one group per
        channel: a batch never mixes channels), in the order their groups first appear."""
        batches: dict[str, tuple[object, list[int]]] = {}
        for i, (is_send, _, peer, _) in enumerate(ops):
            group, gname = self._channel(self.rank, peer) if is_send else self._channel(peer, self.rank)
            batches.setdefault(gname, (group, []))[1].append(i)
        handles: list[Handle | None] = [None] * len(ops)
        for gname, (group, idx) in batches.items():
            for i, h in zip(idx, self._post_batch(group, gname, [ops[i] for i in idx],
                                                  None if labels is None else [labels[i] for i in idx])):
                handles[i] = h
        return handles

    def _post_batch(self, group, gname: str, ops, labels) -> list[Handle]:
        handles, p2p, views = [], [], []
        for i, (is_send, name, peer, tensor) in enumerate(ops):
            _, stage, mb = labels[i] if labels is not None else (None, None, None)
            to = self._peer(peer)
            if is_send:
                wire = tensor.detach().to("cpu", copy=True) if self.staged else tensor.detach().contiguous()
            else:
                wire = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu") if self.staged else tensor
            # the backend (or the strict transport) gets an alias: the emulated device sees the runtime release it
            view = self.comms.dev.backend_view(wire) if self.comms.dev is not None else wire
            views.append(view)
            if self.strict is None:
                p2p.append(dist.P2POp(dist.isend if is_send else dist.irecv, view, to, group))
            handles.append(Handle(is_send, name, to, stage, mb, tensor, wire))  # messages name the global rank
        if not handles:
            return handles
        spans = [(name.split("/", 1)[0], h.stage, h.mb, h.peer, f"{name}~comm")
                 for (_, name, _, _), h in zip(ops, handles)]
        batch = [(h.is_send, h.name, h.peer, v) for h, v in zip(handles, views)] if self.strict is not None else None

        def post():
            return [self.strict.post(group, gname, batch)] if batch is not None else dist.batch_isend_irecv(p2p)

        try:
            works, tokens = self.comms.launch(post, spans, group=gname, pg=group, kind="p2p",
                                              ops=[("send" if h.is_send else "recv", h.peer, h.name) for h in handles],
                                              tensors=views)
        except PipelineError:
            raise
        except Exception as err:  # noqa: BLE001 - backend errors have no common type
            names = ", ".join(f"{h.name} {'to' if h.is_send else 'from'} rank {h.peer}" for h in handles)
            raise PipelineError(f"rank {self.comms.rank}: posting {names} on {gname} failed: {describe(err)}") from None
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


# NCCL's watchdog aborts the process at its process-group timeout, without our one-line error. The step deadline
# (train.timeout_s) is what reports a hang; the watchdog must come well after it, also for step 1 (Triton JIT, the
# communicators' first connections, the pipeline's fill), which can take far longer than a steady step.
NCCL_WATCHDOG_FACTOR = 10
NCCL_WATCHDOG_MIN_S = 900.0
_BLOCKING_WAIT_VARS = ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")


def process_group_timeout_s(backend: str, step_timeout_s: float, first_step_timeout_s: float = 0.0) -> float:
    """The process group's timeout (the world's and every subgroup's): the step deadline on gloo (our waits carry
    their own deadlines), and on NCCL well above it, and above the first step's deadline, so the deadline's error
    comes first."""
    if backend != "nccl":
        return float(step_timeout_s)
    return max(NCCL_WATCHDOG_FACTOR * float(step_timeout_s), NCCL_WATCHDOG_MIN_S,
               float(first_step_timeout_s) + NCCL_WATCHDOG_MIN_S / 3)


def override_blocking_wait(env) -> str | None:
    """TORCH_NCCL_BLOCKING_WAIT=1 (common in cluster job templates) makes every `Work.wait()` block the host. The
    runtime queues waits on CUDA streams for receives it posted early (their senders may need this rank's next
    output), so a blocking wait deadlocks the pipeline at its first backward. It is set back to 0 before the
    process group exists; returns the one line to print, or None when it was not set."""
    found = {name: env[name] for name in _BLOCKING_WAIT_VARS
             if env.get(name, "0").strip().lower() not in ("0", "", "false")}
    if not found:
        return None
    for name in found:
        env[name] = "0"
    was = ", ".join(f"{name}={value}" for name, value in found.items())
    return (f"{was} overridden to 0: the pipeline queues waits for early receives on CUDA streams and a blocking "
            "wait would deadlock it; hangs are still reported by the step deadline (train.timeout_s) and NCCL's "
            "watchdog")


def restart_round_store(env, timeout: datetime.timedelta):
    """Under torchrun (TORCHELASTIC_USE_AGENT_STORE), the agent's store with a prefix of its own per restart
    round, else None (init_process_group's env:// store).

    Why: torchrun's agent keeps one store across restarts (`--max-restarts`), and the process group's keys (each
    rank's gloo address, NCCL's unique id) have the same names in every round: a restarted rank that reads its peer's
    key before the peer rewrote it connects to the dead process of the round before, and the group never forms
    ("Gloo connectFullMesh failed ... Connection refused"). The round: every worker adds 1 to a counter when it
    starts, so the n-th arrival belongs to round (n - 1) // world; TORCHELASTIC_RESTART_COUNT would not do, it counts
    each node's own restarts and differs between nodes."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    world = int(env["WORLD_SIZE"])
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timeout)
    arrival = store.add("mhcpipe/arrivals", 1)
    return dist.PrefixStore(f"mhcpipe/round_{(arrival - 1) // world}", store)


def init_distributed(backend: str, timeout_s: float, device: torch.device | None = None,
                     first_step_timeout_s: float = 0.0) -> str | None:
    """init_process_group from torchrun's environment. `timeout_s` is the step deadline; the process group gets
    `process_group_timeout_s` of it. NCCL: bound to this rank's GPU (`device_id`), so the communicators are created
    now, collectively, and every subgroup is split from them when it is made, instead of lazily at a first op that
    not every rank reaches together; a blocking-wait setting is overridden first (`override_blocking_wait`,
    whose line is returned for the caller to print)."""
    import os

    note = override_blocking_wait(os.environ) if backend == "nccl" else None
    extra = {"device_id": device} if backend == "nccl" and device is not None and device.type == "cuda" else {}
    pg_timeout = datetime.timedelta(seconds=process_group_timeout_s(backend, timeout_s, first_step_timeout_s))
    try:
        store = restart_round_store(os.environ, pg_timeout)
        if store is not None:
            extra.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        dist.init_process_group(backend, timeout=pg_timeout, **extra)
    except Exception as err:  # noqa: BLE001
        raise PipelineError(f"could not join the process group ({backend}): {describe(err)}") from None
    return note
