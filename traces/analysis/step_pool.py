"""One analysis per step, the steps spread over processes: `whatif` builds and replays each step's dependency graph
on its own (~6 ms a step of ~600 spans, all Python), so a run's 10^3 steps take as many cores as it is given.

    map_steps(work, steps, jobs) -> [work(k) for k in steps], in that order

`work` may be any callable (a closure over the trace): the workers are forked after it exists and find it in
their copy of this process, so neither it nor the trace is pickled; only each step's result comes back. Forked
workers share the parent's pages until they write them; the cyclic collector is frozen before the fork
(gc.freeze) so that its passes do not write to every object's header and copy the whole trace into each worker.
Serial where forking is not available (a platform without fork), not worth it (fewer than MIN_STEPS steps, one
job) or where the caller asks for one job (`--jobs 1`). A step that raises (TraceError) raises in the caller.
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import warnings
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")
MIN_STEPS = 64  # fewer steps: a pool's start (~50 ms) is more than it saves
CHUNKS_PER_JOB = 4  # steps are handed out in this many contiguous chunks per worker: slow steps even out

_WORK: Callable | None = None  # the forked workers' work (set in the parent just before the fork)


def default_jobs() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def map_steps(work: Callable[[int], T], steps: Sequence[int], jobs: int | None = None) -> list[T]:
    """[work(k) for k in steps], computed by up to `jobs` forked processes (None: default_jobs())."""
    jobs = default_jobs() if jobs is None else jobs
    if jobs < 1:
        raise ValueError(f"--jobs {jobs}: give a number of processes >= 1")
    steps = list(steps)
    if jobs == 1 or len(steps) < MIN_STEPS or "fork" not in multiprocessing.get_all_start_methods():
        return [work(k) for k in steps]
    n = min(len(steps), jobs * CHUNKS_PER_JOB)
    chunks = [steps[i * len(steps) // n:(i + 1) * len(steps) // n] for i in range(n)]
    global _WORK
    _WORK = work
    gc.freeze()  # the trace's objects out of the collector's reach: its passes would copy them into every worker
    try:
        with warnings.catch_warnings():
            # Python 3.12 warns about fork in a process with threads (BLAS's idle pool here); the workers only run
            # this module's Python and return
            warnings.simplefilter("ignore", DeprecationWarning)
            with multiprocessing.get_context("fork").Pool(min(jobs, n)) as pool:
                parts = pool.map(_run_chunk, chunks, chunksize=1)
    finally:
        _WORK = None
        gc.unfreeze()
    return [r for part in parts for r in part]


def _run_chunk(chunk: list[int]) -> list:
    assert _WORK is not None, "map_steps: a worker without work (not forked from map_steps)"
    return [_WORK(k) for k in chunk]
