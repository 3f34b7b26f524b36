"""Persistent rank processes for the multi-rank tests: `launch(worker, world, args, ...)` with the signature and the
results of `pipeline.launch.local.launch`, but the `world` processes (4 or 2 here) are started once and run case after
case, so a test pays torch's import and the spawn of 4 interpreters once per session instead of once per launch.
The processes are forked from a multiprocessing fork server that imported torch and the runtime once, so even a
replacement set (below) starts in a fraction of a second; their imports are frozen out of garbage collection.

Design (after torch's MultiProcContinuousTest, written small): the parent hosts the job's TCPStore for the whole
session; each case is one message to every rank (the worker, its arguments, the parent's `sys.path` and
environment). A rank then joins a fresh default process group on a store prefix of its own (`case<k>/`), so the
case's meshes and channel groups are created from that world exactly as under torchrun, runs the worker, and
destroys the default group (every group of the case goes with it). Between cases a rank restores its environment,
collects garbage and resets torch's global RNG, default dtype, thread count and the process's cores: nothing of one case
is seen by the next.

Failures keep `launch`'s semantics: a rank whose worker raises writes its error and exits at once (os._exit: a
group with a dead peer must not be torn down politely), the others get `grace_s` to fail on their own, and ranks
still running at the case's deadline are killed. After any case that did not end cleanly on every rank, the
whole set of processes is discarded and a new one starts at once (its ranks import torch while the test checks
the failed case's results): a failing case can never poison the cases after it. Results travel through files (tensors
included) as with `launch`.
"""
from __future__ import annotations

import atexit
import datetime
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.launch.local import RankResult, free_port, run_or_die

_INIT_TIMEOUT_S = 30.0


def _serve(rank: int, world: int, port: int, conn) -> None:
    """A rank's loop: one case per message until the parent closes the pipe."""
    os.environ.pop("TRITON_INTERPRET", None)
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                          timeout=datetime.timedelta(seconds=_INIT_TIMEOUT_S))
    import pipeline.runtime.train  # noqa: F401 - the runtime's imports are paid once, before the first case

    # what exists now lives for the whole session: out of every collection (the runtime's manual_gc then walks
    # only what a case creates)
    gc.collect()
    gc.freeze()
    cores = os.sched_getaffinity(0)  # a case may bind this process to cores (train.cpu_bind): undone per case
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            os._exit(0)
        case, paths, env, worker, args, out_dir = msg
        for p in reversed(paths):
            if p not in sys.path:
                sys.path.insert(0, p)
        os.environ.clear()
        os.environ.update(env)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
        os.environ.pop("TRITON_INTERPRET", None)
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(1)
        torch.manual_seed(0)
        torch.set_default_dtype(torch.float32)

        def init() -> None:  # a fresh world on this case's own store prefix
            dist.init_process_group("gloo", store=dist.PrefixStore(f"case{case}", store), rank=rank,
                                    world_size=world, timeout=datetime.timedelta(seconds=_INIT_TIMEOUT_S))

        run_or_die(rank, world, worker, args, Path(out_dir) / f"rank{rank}.pt", init)
        gc.collect()
        sys.stdout.flush()
        conn.send(("done", case))


class RankPool:
    """`world` rank processes serving cases one at a time (see the module docstring)."""

    def __init__(self, world: int):
        import torch.multiprocessing as mp

        self.world = world
        self.port = free_port()
        # the parent hosts the store so it outlives any rank (the strict transport's hang report reads it)
        self.store = dist.TCPStore("127.0.0.1", self.port, world, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=_INIT_TIMEOUT_S))
        # forked from a server that has imported torch and the runtime once, not spawned: each set of ranks, and
        # each replacement after a failing case, starts in a fraction of a second instead of ~6 CPU-seconds a rank.
        # torch._dynamo: what torch.optim imports on a process's first optimizer (2.5 s). (Python 3.11's fork
        # server imports these before it applies the parent's sys.path: installed packages only.)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["pipeline.runtime.train", "torch._dynamo"])
        self.conns, self.procs = [], []
        for r in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(r, world, self.port, child), daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        self.cases = 0
        self.ready = False

    def wait_ready(self) -> None:
        """Until every rank has imported the runtime and joined the store (the start overlaps whatever the test
        process does meanwhile)."""
        deadline = time.monotonic() + 120.0
        for r, c in enumerate(self.conns):
            try:
                while not c.poll(0.1):
                    if not self.procs[r].is_alive() or time.monotonic() > deadline:
                        raise EOFError
                c.recv()
            except EOFError:
                code = self.procs[r].exitcode
                self.close()
                raise RuntimeError(f"rank pool: rank {r} of {self.world} did not start (exit code {code}; its "
                                   "stderr above says why)") from None
        self.ready = True

    def run(self, worker, args: tuple, timeout_s: float, grace_s: float,
            hung: frozenset[int] = frozenset()) -> tuple[list[RankResult], bool]:
        """One case on every rank; returns the results and whether every rank ended it cleanly (else the pool
        must be discarded). Ranks in `hung` are the case's own hung ranks: once every other rank has ended and one
        of them failed, the case ends (the hung ones are killed) instead of waiting out the grace."""
        if not self.ready:
            self.wait_ready()
        self.cases += 1
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="rank_pool_") as out_dir:
            msg = (self.cases, list(sys.path), dict(os.environ), worker, args, out_dir)
            for c in self.conns:
                c.send(msg)
            ended: dict[int, float] = {}
            codes: dict[int, int] = {}
            deadline = started + timeout_s
            def over() -> bool:
                if len(ended) == self.world:
                    return True
                return bool(hung) and set(ended) | hung == set(range(self.world)) and any(codes.values())

            while not over() and time.monotonic() < deadline:
                for r in range(self.world):
                    if r in ended:
                        continue
                    c, p = self.conns[r], self.procs[r]
                    if c.poll():
                        try:
                            c.recv()
                            codes[r] = 0
                        except EOFError:  # the rank died after its last message
                            p.join(5)
                            codes[r] = p.exitcode if p.exitcode is not None else 1
                        ended[r] = time.monotonic() - started
                    elif not p.is_alive():
                        codes[r] = p.exitcode
                        ended[r] = time.monotonic() - started
                    else:
                        continue
                    if codes[r] != 0:
                        deadline = min(deadline, time.monotonic() + grace_s)
                time.sleep(0.01)
            clean = len(ended) == self.world and all(code == 0 for code in codes.values())
            if not clean:
                self.close()
            results = []
            for r in range(self.world):
                path = Path(out_dir) / f"rank{r}.pt"
                blob = torch.load(path, weights_only=False) if path.exists() else {}
                results.append(RankResult(r, codes.get(r), blob.get("value"), blob.get("error"),
                                          ended.get(r, timeout_s)))
        return results, clean

    def close(self) -> None:
        for c in self.conns:
            c.close()
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        self.conns, self.procs = [], []


_pools: dict[int, RankPool] = {}
_spares: dict[int, RankPool] = {}


def launch(worker, world: int, args: tuple = (), *, timeout_s: float = 120.0, init_timeout_s: float = 30.0,
           grace_s: float = 30.0, hung: frozenset[int] = frozenset()) -> list[RankResult]:
    """`pipeline.launch.local.launch` on the session's persistent ranks (started on first use, replaced after a case
    that did not end cleanly). `init_timeout_s` is accepted for the same signature; the pool's start has its
    own bound.

    Failing cases come in runs (the deadlock, fault and crash tests), and each one costs a new set of ranks:
    once a case of this world size has failed, a spare set is kept starting in the background, so the next
    replacement is ready (its start overlapped the failing case's timeout wait) instead of starting then.
    `hung`: ranks the case makes hang on purpose (fault tests), not waited for once the others have failed."""
    del init_timeout_s
    pool = _pools.get(world)
    if pool is None:
        pool = _pools[world] = RankPool(world)
    results, clean = pool.run(worker, args, timeout_s, grace_s, frozenset(hung))
    if not clean:
        _pools[world] = _spares.pop(world, None) or RankPool(world)
        _spares[world] = RankPool(world)
    return results


@atexit.register
def close_all() -> None:
    for pool in list(_pools.values()) + list(_spares.values()):
        pool.close()
    _pools.clear()
    _spares.clear()
