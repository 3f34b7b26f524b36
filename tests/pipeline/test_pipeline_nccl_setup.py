"""What a CUDA launch decides before its process group exists, checked on CPU: the NCCL watchdog's timeout, a
blocking-wait setting, and whether the ranks of a node share a GPU (pipeline.distributed.p2p,
pipeline.launch.gpu_sharing)."""
from __future__ import annotations

import threading

import torch.distributed as dist

from pipeline.distributed.p2p import override_blocking_wait, process_group_timeout_s
from pipeline.launch.gpu_sharing import shares_a_gpu


def test_nccl_watchdog_comes_well_after_the_step_deadline():
    """The step deadline's one-line error must come first: step 1 (JIT, first connections, fill) may take many
    steady steps, so NCCL's process-group timeout is 10x the deadline and never under 15 minutes; gloo keeps it."""
    assert process_group_timeout_s("nccl", 60.0) == 900.0
    assert process_group_timeout_s("nccl", 300.0) == 3000.0
    assert process_group_timeout_s("gloo", 60.0) == 60.0


def test_blocking_wait_is_overridden_with_one_line():
    env = {"TORCH_NCCL_BLOCKING_WAIT": "1", "PATH": "/bin"}
    line = override_blocking_wait(env)
    assert env["TORCH_NCCL_BLOCKING_WAIT"] == "0" and env["PATH"] == "/bin"
    assert line is not None and "\n" not in line and "TORCH_NCCL_BLOCKING_WAIT=1 overridden to 0" in line
    legacy = {"NCCL_BLOCKING_WAIT": "true"}
    assert "NCCL_BLOCKING_WAIT=true" in override_blocking_wait(legacy) and legacy["NCCL_BLOCKING_WAIT"] == "0"
    for unset in ({}, {"TORCH_NCCL_BLOCKING_WAIT": "0"}):
        assert override_blocking_wait(dict(unset)) is None


def _ranks_report(uuids: list[str]) -> list[bool]:
    """Each local rank (a thread) publishes its GPU's UUID in one store and says whether another has the same."""
    store = dist.HashStore()
    out: list = [None] * len(uuids)

    def rank(r: int) -> None:
        out[r] = shares_a_gpu(store, "0/0", r, len(uuids), uuids[r], timeout_s=10)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(uuids))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_one_visible_gpu_per_rank_is_not_a_shared_gpu():
    """SLURM --gpus-per-task=1: device_count() is 1 on every rank, but each sees its own GPU, so NCCL it is (the
    old rule, local ranks > visible GPUs, chose the host-staged transport here)."""
    assert _ranks_report(["GPU-a", "GPU-b", "GPU-c", "GPU-d"]) == [False] * 4


def test_ranks_on_one_gpu_are_found_sharing_it():
    assert _ranks_report(["GPU-a"] * 4) == [True] * 4
    assert _ranks_report(["GPU-a", "GPU-b", "GPU-a", "GPU-c"]) == [True, False, True, False]
