"""How k concurrent ranks share this host's CPU cores: cores(k), the time slice and the protection after a
wake-up, the inputs of costmodel.local.shared_cores.

measure_core_sharing(cfg, k_max, workload) starts k_max single-thread processes that each build one round of
the workload (the runtime's own Transformer block of cfg's shape, pipeline.launch.host_measurements.block_round) and,
for k = 1 .. k_max in turn, let k of them run rounds for `seconds` while the rest wait. cores(k) = the k
processes' summed rounds per second / one process's rate alone. On a dedicated host with c cores this is about
min(k, c); on a shared VM it is what the VM gives, and it can fall beyond c: k > c processes time-slicing c
cores refill their caches after every switch.

measure_time_slice(k) lets k busy processes spin, each stamping the clock every few microseconds; a jump in its
stamps is a time it was descheduled. The median length of the runs between jumps is the scheduler's time slice
under that load (one scheduler tick, e.g. 4 ms at 250 Hz). An action shorter than the slice that starts on a
core mostly ends before it is preempted, so it runs at full speed however many ranks compute
(costmodel.local.shared_cores schedules the ranks on the cores in such slices).

measure_protection(k, slice_us) lets half of k processes spin while the others wake up from short sleeps into
the busy cores and spin until they are descheduled: the median of their first on-CPU run after a wake-up. The
scheduler preempts a task at the first tick after it has run its base slice, and a wake-up falls anywhere
between two ticks, so that median is the base slice plus half a tick: protection = median - slice / 2.
"""
from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from typing import Callable


def _worker(index: int, workload: Callable[[dict], Callable[[], None]], cfg_dict: dict, plan: list[int],
            seconds: float, start, results) -> None:
    import torch

    torch.set_num_threads(1)
    one_round = workload(cfg_dict)
    for _ in range(3):
        one_round()
    for phase, k in enumerate(plan):
        start.wait()
        if index < k:
            rounds, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                one_round()
                rounds += 1
            results.put((phase, index, rounds / (time.perf_counter() - t0)))
        start.wait()


def _gather(procs, results, count: int, timeout_s: float, what: str) -> list:
    """Start the worker processes, take `count` results off their queue, and always reap them: a lost worker
    ends the measurement with an error, not a hang."""
    for p in procs:
        p.start()
    try:
        return [results.get(timeout=timeout_s) for _ in range(count)]
    except Exception as err:  # noqa: BLE001 - queue.Empty or a dead worker
        raise RuntimeError(f"{what} measurement did not finish within {timeout_s:g} s: "
                           f"{type(err).__name__}") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def measure_core_sharing(cfg, k_max: int, workload: Callable[[dict], Callable[[], None]], seconds: float = 0.25,
                         cycles: int = 12, timeout_s: float = 120.0) -> list[float]:
    """[cores(1), ..., cores(k_max)] for cfg's block on this host (see the module docstring). `workload(cfg_dict)`
    builds one round of the work (pipeline.launch.host_measurements.block_round); it runs in other processes, so it
    must be a module-level function. The sweep k = 1 .. k_max runs `cycles` times, each closed by a solo phase;
    a cycle's cores(k) is its rate at k over the mean of the solo rates at both of its ends, and the result is
    the median over cycles (shared VMs drift and stall, so single phases are noisy). Many short cycles rather
    than a few long ones: a shared VM's speed can switch within seconds, and short cycles put both ends of a
    cycle in the same state."""
    if k_max < 1 or cycles < 1:
        raise ValueError(f"k_max and cycles must be >= 1, got k_max={k_max}, cycles={cycles}")
    sweep = list(range(1, k_max + 1))
    plan = [1] + sweep * cycles + [1]  # the first phase only warms the machine up
    # forked from a fork server that imported the workload's module (torch and the runtime) once: spawned
    # processes each imported them again, seconds of CPU per process on the cores being measured. (A fork server
    # that already runs keeps its own preload; the workers then import what it lacks.)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, workload.__module__])
    start = ctx.Barrier(k_max, timeout=timeout_s)
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(i, workload, cfg.model_dump(), plan, seconds, start, results),
                         daemon=True)
             for i in range(k_max)]
    rates: dict[int, float] = {}
    for phase, _, r in _gather(procs, results, sum(plan), timeout_s, "core-sharing"):
        rates[phase] = rates.get(phase, 0.0) + r
    per_k: dict[int, list[float]] = {k: [] for k in sweep}
    for c in range(cycles):
        first = 1 + c * k_max  # phase of this cycle's solo; the next solo closes it
        solo = 0.5 * (rates[first] + rates[first + k_max])
        for k in sweep:
            per_k[k].append(rates[first + k - 1] / solo)
    return [statistics.median(per_k[k]) for k in sweep]


def _slice_worker(seconds: float, results) -> None:
    clock = time.perf_counter
    stamps = []
    t_end = clock() + seconds
    t = clock()
    while t < t_end:
        sum(range(300))  # a few microseconds of work between two stamps
        t = clock()
        stamps.append(t)
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    unit = statistics.median(steps) if steps else 0.0
    runs, start = [], stamps[0] if stamps else 0.0
    for a, b in zip(stamps, stamps[1:]):
        if b - a > max(50e-6, 20 * unit):  # descheduled between a and b
            runs.append(a - start)
            start = b
    results.put(runs)


def measure_time_slice(k: int, seconds: float = 0.5, timeout_s: float = 60.0, repeats: int = 3) -> float:
    """Median on-CPU run (us) of k processes that all want a core (see the module docstring); 0 when they were
    almost never descheduled (k <= cores: there is nothing to share). The median over `repeats` independent
    measurements of `seconds` each, so that one disturbed by another process waking up does not decide it."""
    if k < 1 or repeats < 1:
        raise ValueError(f"k and repeats must be >= 1, got k={k}, repeats={repeats}")
    slices = []
    for _ in range(repeats):
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [ctx.Process(target=_slice_worker, args=(seconds, results), daemon=True) for _ in range(k)]
        runs = [r for got in _gather(procs, results, k, timeout_s, "time-slice") for r in got]
        # fewer switches than one per 50 ms and process: the processes had their own cores
        slices.append(statistics.median(runs) * 1e6 if len(runs) >= k * seconds / 0.05 else 0.0)
    return statistics.median(slices)


def _wake_worker(seconds: float, spin_limit_s: float, results) -> None:
    import random

    clock = time.perf_counter
    first_runs = []
    t_end = clock() + seconds
    while clock() < t_end:
        time.sleep(random.uniform(0.002, 0.010))
        t0 = t = clock()
        while t - t0 < spin_limit_s:
            sum(range(300))
            now = clock()
            if now - t > 50e-6:  # descheduled between t and now
                first_runs.append(t - t0)
                break
            t = now
    results.put(first_runs)


def _spin_worker(seconds: float, results) -> None:
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        sum(range(300))
    results.put([])


def measure_protection(k: int, slice_us: float, seconds: float = 1.0, timeout_s: float = 60.0) -> float:
    """How long (us) a process that wakes up into k busy processes keeps its core before a tick may take it
    (see the module docstring); 0 when there is no slice or the wakers were almost never descheduled (k <=
    cores: there is nothing to share)."""
    if k < 1 or slice_us < 0:
        raise ValueError(f"k must be >= 1 and slice_us >= 0, got k={k}, slice_us={slice_us}")
    if k < 2 or not slice_us:
        return 0.0
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    wakers = k // 2
    spin_limit_s = 5 * slice_us * 1e-6
    procs = ([ctx.Process(target=_wake_worker, args=(seconds, spin_limit_s, results), daemon=True)
              for _ in range(wakers)] +
             [ctx.Process(target=_spin_worker, args=(seconds + spin_limit_s + 0.05, results), daemon=True)
              for _ in range(k - wakers)])
    runs = [r for got in _gather(procs, results, k, timeout_s, "protection") for r in got]
    if len(runs) < wakers * seconds / 0.05:  # fewer than one preemption per 50 ms and waker
        return 0.0
    return max(0.0, statistics.median(runs) * 1e6 - slice_us / 2)
