"""CPU binding of the ranks of one host (CPU runs): which cores each local rank's threads may use.

With more ranks than cores (4 gloo ranks on 2 cores) Linux moves the ranks between cores as it likes, so two
ranks that must meet in a collective (expert-parallel peers, consecutive ranks of a data-parallel group) are
often not running at the same time, and each all-to-all waits for the peer's next time slice. Binding
consecutive local ranks to different cores (rank i -> core i mod cores; with cores to spare, a block of
cores per rank) lets them run side by side; pipeline neighbours, which mostly take turns anyway, share a core.
This is what `numactl --physcpubind` / `taskset` per rank would do; `train.cpu_bind` (`--cpu-bind`) turns it on.
Every thread the process has at that moment is bound (the backend's and the F&B helper's included), and
threads created later inherit it.
"""
from __future__ import annotations

import os


def cores_for(local_rank: int, local_world: int, cores: list[int]) -> set[int]:
    """The cores of `local_rank` among `local_world` ranks sharing `cores`."""
    if not cores:
        raise ValueError("no CPU cores available to bind to")
    per_rank = max(1, len(cores) // max(1, local_world))
    first = (local_rank * per_rank) % len(cores)
    return {cores[(first + k) % len(cores)] for k in range(per_rank)}


def bind_cpus(local_rank: int, local_world: int) -> set[int]:
    """Bind every thread of this process to its cores; returns them."""
    allowed = sorted(os.sched_getaffinity(0))
    mine = cores_for(local_rank, local_world, allowed)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), mine)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that just ended
    return mine
