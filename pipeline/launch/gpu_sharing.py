"""Do the ranks of a node share a GPU? Decides between NCCL and the host-staged transport (NCCL refuses two ranks
on one GPU).

With at least as many visible GPUs as local ranks, each rank takes GPU LOCAL_RANK: nothing is shared. With fewer,
two launches look alike: every rank sees one and the same GPU (several ranks on one device), or every rank sees
only its own (SLURM `--gpus-per-task=1`, a CUDA_VISIBLE_DEVICES per rank), where `device_count()` is 1 on every
rank although no GPU is shared. The ranks of the node then compare their GPUs' UUIDs through torchrun's store,
before any process group exists (torchrun's agent store). `choose_backend` turns the answer into the run's backend
and the one line that says why; nothing falls back to the host-staged transport unless `--transport host` asks for
it: ranks that share a GPU, or whose sharing cannot be checked, stop with one line naming the fix.
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


def choose_backend(device: torch.device, local_rank: int, local_world: int, transport: str, emulate: bool,
                   timeout_s: float = 60.0) -> tuple[str, bool, str]:
    """(backend, host-staged, why) of a rank on `device`; a ValueError (one line) when NCCL cannot run and the user
    did not ask for the host-staged transport."""
    if device.type != "cuda":
        why = "the emulated CUDA device on CPU tensors (--emulate-cuda)" if emulate else "CPU tensors"
        return "gloo", False, why
    if transport == "host":
        return "gloo", True, "host-staged P2P (--transport host)"
    shared = gpu_shared_with_another_rank(device, local_rank, local_world, timeout_s)
    visible = torch.cuda.device_count()
    if shared is None:
        raise ValueError(f"{local_world} ranks on this node see {visible} GPU(s) and whether they share one cannot be "
                         "checked (no torchrun agent store or no GPU UUID): start one rank per GPU, or pass "
                         "--transport host if they share a GPU (NCCL refuses two ranks on one GPU)")
    if shared:
        raise ValueError(f"local rank {local_rank} shares its GPU with another rank of this node: NCCL refuses two "
                         "ranks on one GPU; pass --transport host (host-staged P2P, no --dp/--ep) or start one rank "
                         "per GPU")
    return "nccl", False, f"one GPU per rank ({local_world} local ranks, {visible} visible GPU(s) each)"


def gpu_shared_with_another_rank(device: torch.device, local_rank: int, local_world: int,
                                 timeout_s: float = 60.0) -> bool | None:
    """For a rank started by torchrun on `device` (a CUDA device): see the module docstring. None: it cannot be
    told (no torchrun agent store, or no GPU UUID)."""
    if local_world <= 1 or torch.cuda.device_count() >= local_world:
        return False
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    # the UUIDs travel through the launcher's store, which exists before any rank's process group only when
    # torchrun hosts it (its agent store)
    if uuid is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    uuid = str(uuid)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    # the node (torchrun's GROUP_RANK) and the restart: a restarted job must not read the last attempt's keys
    node = f"{os.environ.get('GROUP_RANK', '0')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return shares_a_gpu(store, node, local_rank, local_world, uuid, timeout_s)
