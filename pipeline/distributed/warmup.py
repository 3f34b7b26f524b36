"""Start-up warm-up: one small op on every communicator the runtime uses, in one order that every rank agrees on,
before the first step.

Why: NCCL connects lazily. The first op to a peer on a communicator blocks the posting host until that peer posts on
the communicator too, and the first collective on a group blocks until every member posts one. In a step, a rank
posts receives early (a neighbour's next output) and an F&B pair's halves post all-to-alls while the other half
computes: a first post that blocks there can wait for a peer that is itself waiting for this rank's output, and the
job hangs at step 1. Here every rank walks the same list, sorted by group name (the same string on every member),
and does the ops of the groups it belongs to one at a time, blocking: the first op of the list that has not
completed has all its members at it (each finished every earlier op it belongs to), so the walk always finishes.
After it, no post of the runtime connects. On gloo (CPU) the groups are connected when they are made and this costs a
few small messages; the strict transport (pipeline.distributed.strict_transport) applies NCCL's lazy-connection rule,
so CPU tests see a posting order that needs this walk.

The P2P channels are warmed by a one-element send from the channel's sender to its receiver; the expert groups by
a one-element-per-peer all-to-all (NCCL builds an all-to-all from send/receive pairs and connects each pair at its
first use, which an all-reduce does not do: without this the first MoE layer of step 1 connects, a host-blocking
rendezvous in the middle of an F&B pair); the other collective groups (gradient all-reduces, the world group) by a
one-element all-reduce. The legacy shared P2P group (parallel.p2p_groups 'shared', kept to show its deadlock) is
left alone. With a device layer (CUDA, emulated CUDA) every op goes through it; the walk ends with the program mark
`warm-up done`, after which `mhcpipe check-comm --cuda` reports any connection a step still makes.
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist

from pipeline.distributed import op_ledger
from pipeline.distributed.collective import collective, wait_work
from pipeline.distributed.errors import PipelineError, describe
from pipeline.distributed.group_plan import warmup_order

_CHANNEL = re.compile(r"p2p:(\d+)>(\d+)")


def warmup_plan(groups) -> list[tuple[str, object]]:
    """(name, group) of every group this rank's runtime uses, in the walk's order."""
    used = {}
    for g in (*(groups.p2p_channels or {}).values(), *(groups.ep_groups or {}).values(), groups.dense_grad_group,
              groups.expert_grad_group, *groups.tie_groups.values(), groups.world_group):
        if g is not None:
            used[groups.name_of(g)] = g
    return warmup_order(list(used.items()), name=lambda item: item[0])


def warm_up(groups, device: torch.device, timeout_s: float, strict=None, dev=None) -> list[str]:
    """Connect every group of `warmup_plan` (see the module docstring); returns the names in the order walked.
    `strict`: the strict transport, which then carries the P2P ops (and notes the collectives) as in a step.
    `dev`: the device layer (pipeline.device), through which the ops are posted and waited."""
    if groups.world_group is None:
        return []
    expert = {id(g) for g in (groups.ep_groups or {}).values()}
    nccl = device.type == "cuda" and dist.get_backend(groups.world_group) == "nccl"
    on = device if nccl else torch.device("cpu")
    walked = []
    for name, group in warmup_plan(groups):
        channel = _CHANNEL.fullmatch(name)
        if channel:
            src, dst = int(channel.group(1)), int(channel.group(2))
            _p2p(name, group, src, dst, groups.rank, on, timeout_s, strict, dev)
        elif id(group) in expert:  # every pair of the group, as the step's all-to-alls use them
            size = dist.get_world_size(group)
            t, out = torch.ones(size, device=on), torch.empty(size, device=on)
            if strict is not None:
                strict.note_collective(name, dist.get_process_group_ranks(group), "all_to_all_single",
                                       f"WARMUP/{name}", [out, t])
            collective(dist.all_to_all_single, out, t, what=f"the start-up warm-up of {name}", rank=groups.rank,
                       timeout_s=timeout_s, group=group, dev=dev, comm=name)
        else:
            t = torch.ones(1, device=on)
            if strict is not None:
                strict.note_collective(name, dist.get_process_group_ranks(group), "all_reduce", f"WARMUP/{name}",
                                       [t])
            collective(dist.all_reduce, t, what=f"the start-up warm-up of {name}", rank=groups.rank,
                       timeout_s=timeout_s, group=group, dev=dev, comm=name)
        walked.append(name)
    if strict is not None:
        strict.forget_collectives()  # the warm-up's collectives are no step's
    if dev is not None:
        dev.mark("warm-up done")
    return walked


def _p2p(name: str, group, src: int, dst: int, rank: int, device: torch.device, timeout_s: float, strict,
         dev=None) -> None:
    sending = rank == src
    peer = dst if sending else src
    t = torch.zeros(1, device=device)
    op = f"{'SEND' if sending else 'RECV'}_WARMUP/{src}>{dst}"
    try:
        views = []
        if strict is not None:
            def post():
                return [strict.post(group, name, [(sending, op, peer, t)])]
        else:
            op_ledger.note(group, "p2p", [op], label=name)
            views = [dev.backend_view(t) if dev is not None else t]
            p2p = [dist.P2POp(dist.isend if sending else dist.irecv, views[0], peer, group)]

            def post():
                return dist.batch_isend_irecv(p2p)
        if dev is not None:
            (work,) = dev.post(post, comm=name, members=[src, dst], ops=[("send" if sending else "recv", peer, op)],
                               tensors=views)
            ok = dev.host_wait_work(work, timeout_s)
        else:
            (work,) = post()
            ok = wait_work(work, timeout_s, polled=device.type == "cuda")
    except PipelineError:
        raise
    except Exception as err:  # noqa: BLE001 - backend errors have no common type
        raise PipelineError(f"rank {rank}: the start-up warm-up of {name} ({op}) failed: {describe(err)}") from None
    if not ok:
        raise PipelineError(f"rank {rank}: the start-up warm-up of {name} ({op}) timed out after {timeout_s:g} s "
                            f"waiting for rank {peer}")
