"""Do the ranks of a node share a GPU? Decides between NCCL and the host-staged transport (NCCL refuses two ranks
on one GPU).

With at least as many visible GPUs as local ranks, each rank takes GPU LOCAL_RANK: nothing is shared. With fewer,
two launches look alike: every rank sees one and the same GPU (several ranks on one device), or every rank sees
only its own (SLURM `--gpus-per-task=1`, a CUDA_VISIBLE_DEVICES per rank), where `device_count()` is 1 on every
rank although no GPU is shared. The ranks of the node then compare their GPUs' UUIDs through torchrun's store,
before any process group exists (torchrun's agent store; without it, fewer GPUs than ranks counts as sharing).
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

_PREFIX = "mhcpipe/gpu-uuid"


def shares_a_gpu(store, node: str, local_rank: int, local_world: int, uuid: str, timeout_s: float) -> bool:
    """Publish this rank's GPU UUID under the node's prefix, wait for the node's other ranks' and say whether one
    of them has the same GPU."""
    keys = [f"{_PREFIX}/{node}/{r}" for r in range(local_world)]
    store.set(keys[local_rank], uuid)
    store.wait(keys, datetime.timedelta(seconds=timeout_s))
    return any(store.get(k).decode() == uuid for r, k in enumerate(keys) if r != local_rank)


def gpu_shared_with_another_rank(device: torch.device, local_rank: int, local_world: int,
                                 timeout_s: float = 60.0) -> bool:
    """For a rank started by torchrun on `device` (a CUDA device): see the module docstring."""
    if local_world <= 1 or torch.cuda.device_count() >= local_world:
        return False
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    # the UUIDs travel through the launcher's store, which exists before any rank's process group only when
    # torchrun hosts it (its agent store); elsewhere, or without UUIDs, fewer GPUs than ranks means sharing
    if uuid is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return True
    uuid = str(uuid)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    # the node (torchrun's GROUP_RANK) and the restart: a restarted job must not read the last attempt's keys
    node = f"{os.environ.get('GROUP_RANK', '0')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return shares_a_gpu(store, node, local_rank, local_world, uuid, timeout_s)
