"""Blocking collectives of the runtime (barriers, the loss and step-statistics all-reduces, the clock exchange,
rank 0's gather of every rank's trace file: `gather_files`) through one helper, and bounded host waits for the GPU.

Device against backend: a process group's backend serves some device types only (NCCL: cuda; gloo: cpu and
cuda; a group created as "cpu:gloo,cuda:nccl" serves each through its own backend). `collective` checks every
tensor it is handed against that map before the backend sees it, so a host tensor on a pure NCCL group is a
one-line error naming the collective and the fix, not a failure deep inside NCCL; `group_device` is where a
caller creates the tensors it reduces. The map is `torch.distributed.Backend.backend_capability` (public),
overridable here (`BACKEND_DEVICES`) so a CPU test can run a gloo group under NCCL's map.

Deadlines: gloo works take `Work.wait(timeout)`. NCCL works are never waited with a timeout (that makes the host
busy-wait until the work ends): their completion is polled (`Work.is_completed`, an event query) with a sleeping
back-off until the deadline, then `Work.wait()` only orders the current stream after them. `synchronize` replaces
`torch.cuda.synchronize` (which has no deadline) with events recorded on the given streams (through the device
layer, pipeline.device) and polled.
"""
from __future__ import annotations

import datetime
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.distributed import op_ledger
from pipeline.device.poll import poll
from pipeline.distributed.errors import PipelineError, describe

# backend name -> device types it serves (NCCL: cuda only); tests may replace an entry to mimic another backend
BACKEND_DEVICES: dict[str, tuple[str, ...]] = {k: tuple(v) for k, v in dist.Backend.backend_capability.items()}


def group_backends(group=None) -> dict[str, str]:
    """{device type: backend} of a process group ("cpu:gloo,cuda:nccl" -> {"cpu": "gloo", "cuda": "nccl"})."""
    name = str(dist.get_backend(group))
    if ":" in name:
        pairs = (item.split(":", 1) for item in name.split(","))
        return {dev.strip(): be.strip() for dev, be in pairs}
    return {dev: name for dev in BACKEND_DEVICES.get(name, ())}


def group_device(group, device: torch.device) -> torch.device:
    """Where tensors reduced over `group` live: the run's `device` when the group's backend serves it, else the
    host when it serves that (a gloo group of a host-staged CUDA run); an error when it serves neither."""
    served = group_backends(group)
    if device.type in served:
        return device
    if "cpu" in served:
        return torch.device("cpu")
    raise ValueError(f"the process group's backend ({dist.get_backend(group)}) serves {sorted(served)} tensors, "
                     f"not this run's device {device}")


def tensor_args(args) -> Iterable[torch.Tensor]:
    """The tensors among a collective's arguments (one level of lists, as all_gather's output list)."""
    for a in args:
        if torch.is_tensor(a):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if torch.is_tensor(t))


def check_devices(args, group, what: str, rank: int) -> str | None:
    """Raise a one-line PipelineError when a tensor in `args` sits on a device the group's backend does not serve;
    returns the backend that will run the collective (None when no tensor decides it)."""
    served = group_backends(group)
    backend = None
    for t in tensor_args(args):
        be = served.get(t.device.type)
        if be is None:
            name = dist.get_backend(group)
            raise PipelineError(f"rank {rank}: {what}: a {t.device.type} tensor on a {name} process group, which "
                                f"serves {'/'.join(sorted(served))} tensors only; create it with "
                                "pipeline.distributed.collective.group_device(group, device)")
        backend = be
    return backend


def wait_work(work, limit: float, polled: bool = False) -> bool:
    """Block until `work` completes or `limit` seconds pass; False on timeout. `polled` (NCCL): poll
    `is_completed()` and then `wait()` (which only orders the current stream), never `wait(timeout)`."""
    if not polled:
        try:
            return work.wait(datetime.timedelta(seconds=limit)) is not False
        except (TypeError, NotImplementedError):
            pass  # backend without a timed wait: poll
    if not poll(work.is_completed, limit):
        return False
    work.wait()
    return True


def collective(fn, *args, what: str, rank: int, timeout_s: float, group=None, dev=None, comm: str | None = None,
               **kwargs):
    """Run `fn(*args, async_op=True, group=group, **kwargs)` (a torch.distributed collective) and wait for it with
    the deadline. Tensors must sit on a device the group's backend serves (checked first); errors are one line
    naming the rank and `what`. `dev` (pipeline.device, with the group's name `comm`): post and wait through the
    device layer, so that the emulated device's program holds the collective."""
    backend = check_devices(args, group, what, rank)
    if backend is None:  # a barrier: the group's own device
        served = group_backends(group)
        backend = served.get("cuda") if torch.cuda.is_available() and "cuda" in served else served.get("cpu")
    op_ledger.note(group if group is not None else dist.group.WORLD, "coll", [what])
    try:
        if dev is not None:
            members = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
            (work,) = dev.post(lambda: [fn(*args, async_op=True, group=group, **kwargs)], comm=comm or "world",
                               members=members, ops=[(fn.__name__, None, what)], tensors=[])
            ok = dev.host_wait_work(work, timeout_s)
        else:
            work = fn(*args, async_op=True, group=group, **kwargs)
            ok = wait_work(work, timeout_s, polled=backend == "nccl")
    except Exception as err:  # noqa: BLE001 - backend errors have no common type
        cause = describe(err)
        if cause == "the backend timed out":
            raise PipelineError(f"rank {rank}: timed out after {timeout_s:g} s in {what}") from None
        raise PipelineError(f"rank {rank}: {what} failed: {cause}") from None
    if not ok:
        raise PipelineError(f"rank {rank}: timed out after {timeout_s:g} s in {what}")


def synchronize(dev, streams, timeout_s: float, what: str, rank: int) -> None:
    """Bounded `torch.cuda.synchronize` on the device layer `dev` (pipeline.device): wait until everything queued so
    far on the current stream and on `streams` (None entries skipped) has run, or raise a PipelineError after
    `timeout_s`. No-op without a device layer (CPU)."""
    if dev is None:
        return
    events = []
    for s in (dev.current_stream(), *streams):
        if s is None:
            continue
        ev = dev.event()
        ev.record(s)
        events.append(ev)
    wait_events(events, timeout_s, what, rank, dev)


def wait_events(events, timeout_s: float, what: str, rank: int, dev=None) -> None:
    """Poll CUDA events (anything with `query()`; through the device layer `dev` when given, so that the emulated
    device's program holds the host wait) until all completed; PipelineError after `timeout_s`."""
    done = dev.host_wait_events(events, timeout_s) if dev is not None else poll(
        lambda: all(ev.query() for ev in events), timeout_s)
    if not done:
        raise PipelineError(f"rank {rank}: timed out after {timeout_s:g} s in {what} (the GPU did not finish the "
                            "work queued before it: a hung kernel or a collective a peer never joined)")


def gather_files(path: Path, world, device: torch.device, rank: int, timeout_s: float, dev=None) -> list[bytes]:
    """Every rank's file at `path` (its own copy), gathered to rank 0 over `world` as bytes (rank order); other
    ranks get []. Two collectives: the sizes (all-gather), then the padded bytes (gather to rank 0)."""
    data = Path(path).read_bytes()
    where = group_device(world, device)
    n = dist.get_world_size(world)
    size = torch.tensor([len(data)], dtype=torch.int64, device=where)
    sizes = [torch.empty_like(size) for _ in range(n)]
    collective(dist.all_gather, sizes, size, what="the trace file sizes all-gather", rank=rank, timeout_s=timeout_s,
               group=world, dev=dev)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
    buf = buf.to(where)
    every = [torch.empty_like(buf) for _ in range(n)] if rank == 0 else None
    collective(dist.gather, buf, gather_list=every, dst=0, what="the trace files gather", rank=rank,
               timeout_s=timeout_s, group=world, dev=dev)
    if rank != 0:
        return []
    return [bytes(t[:int(s.item())].cpu().numpy().tobytes()) for t, s in zip(every, sizes)]
