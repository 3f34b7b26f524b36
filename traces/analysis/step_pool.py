"""One analysis per step, the steps spread over processes: `whatif` builds and replays each step's dependency graph
on its own (~6 ms a step of ~600 spans, all Python), so a run's 10^3 steps take as many cores as it is given.

    map_steps(work, steps, jobs) -> [work(k) for k in steps], in that order

`work` may be any callable (a closure over the trace): the workers are forked (os.fork) after it exists and find
it in their copy of this process, so neither it nor the trace is pickled; only each step's result comes back,
pickled through a pipe per worker. Forked workers share the parent's pages until they write them; the cyclic
collector is frozen before the fork (gc.freeze) so that its passes do not write to every object's header and copy
the whole trace into each worker. A worker runs its steps and leaves with os._exit: no exit handler or finaliser
of the parent's (a test runner's threads, torch's) runs in it, and no pool threads run in the parent
(multiprocessing.Pool's result thread hung a test run once a forked worker's step raised). Serial off Linux (no
fork on Windows; on macOS system frameworks are not safe to fork, which is why Python's multiprocessing spawns
there), where it is not worth it (fewer than MIN_STEPS steps) or asked for (`--jobs 1`). A step that raises
raises in the caller; a worker that dies (killed, out of memory) is one error line naming it.
"""
from __future__ import annotations

import gc
import os
import pickle
import signal
import sys
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")
MIN_STEPS = 64  # fewer steps: forking (~10-50 ms) is more than it saves
CHUNKS_PER_JOB = 4  # a worker's steps: this many contiguous runs spread over the step range (slow stretches even out)


def default_jobs() -> int:
    """The CPUs this process may run on, or 1 when the machine lacks the memory for the workers' copies: together
    they copy about every page of the trace they read (measured: 10^7 spans from .npz, 3.0 -> 5.3 GB with two), so
    the pool is used only when the memory available is at least twice what this process holds."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    held, available = _memory()
    return cpus if available is None or available >= 2 * held else 1


def _memory() -> tuple[int, int | None]:
    """(this process's resident bytes, the machine's available bytes; None: not known)."""
    try:
        with open("/proc/self/statm") as fh:
            held = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return held, int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0, None


def map_steps(work: Callable[[int], T], steps: Sequence[int], jobs: int | None = None) -> list[T]:
    """[work(k) for k in steps], computed by up to `jobs` forked processes (None: default_jobs())."""
    jobs = default_jobs() if jobs is None else jobs
    if jobs < 1:
        raise ValueError(f"--jobs {jobs}: give a number of processes >= 1")
    steps = list(steps)
    if jobs == 1 or len(steps) < MIN_STEPS or not sys.platform.startswith("linux"):
        return [work(k) for k in steps]
    n = min(len(steps), jobs * CHUNKS_PER_JOB)
    chunks = [steps[i * len(steps) // n:(i + 1) * len(steps) // n] for i in range(n)]
    mine = [list(range(j, n, jobs)) for j in range(jobs)]  # worker j: chunks j, j + jobs, ...
    results: list[list | None] = [None] * n
    workers: list[tuple[int, int]] = []  # (pid, read end of its pipe)
    gc.freeze()  # the trace's objects out of the collector's reach: its passes would copy them into every worker
    try:
        for j in range(jobs):
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the worker: its chunks, their results down the pipe, gone
                os.close(r)
                _worker(work, [(c, chunks[c]) for c in mine[j]], w)
            os.close(w)
            workers.append((pid, r))
        failure = None
        for j, (pid, r) in enumerate(workers):  # each pipe to its end in turn: a worker only ever writes its own
            with os.fdopen(r, "rb") as pipe:
                data = pipe.read()
            _, status = os.waitpid(pid, 0)
            workers[j] = (0, -1)
            if failure is not None:
                continue
            if not data:
                failure = RuntimeError(f"step worker {j} (pid {pid}) died without its results "
                                       f"({_how(status)}); run with --jobs 1")
                continue
            try:  # our own objects from the worker forked above, through a pipe only it and this call hold
                ok, payload = pickle.loads(data)
            except Exception as err:  # noqa: BLE001 - an error class that cannot be rebuilt here
                ok, payload = False, RuntimeError(f"step worker {j}: its result could not be read back ({err})")
            if not ok:
                failure = payload
                continue
            for c, got in payload:
                results[c] = got
        if failure is not None:
            raise failure
    finally:
        for pid, r in workers:  # interrupted while reading: no worker outlives the call
            if pid:
                _stop(pid)
            if r >= 0:
                try:
                    os.close(r)
                except OSError:
                    pass
        gc.unfreeze()
    return [x for got in results for x in got]


def _worker(work: Callable, chunks: list[tuple[int, list[int]]], fd: int) -> None:
    code = 0
    try:
        try:
            out = (True, [(c, [work(k) for k in ks]) for c, ks in chunks])
        except BaseException as err:  # noqa: BLE001 - reported to the caller, which raises it
            code = 1
            out = (False, err)
        try:
            data = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # noqa: BLE001 - a result or error that cannot be pickled
            code = 1
            data = pickle.dumps((False, RuntimeError(f"step worker: {type(err).__name__}: {err}")))
        with os.fdopen(fd, "wb") as pipe:
            pipe.write(data)
    finally:
        os._exit(code)  # no exit handlers, finalisers or buffered output of the parent's run here


def _how(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"killed by {signal.Signals(sig).name}" + (" - out of memory?" if sig == signal.SIGKILL else "")
    return f"exit code {os.WEXITSTATUS(status)}"


def _stop(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
