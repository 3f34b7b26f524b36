"""Launch a pipeline on local CPU processes (gloo) without torchrun: for tests and benchmarks.

`launch(worker, world, args, timeout_s)` spawns `world` processes, each joining a gloo process group through a
TCPStore the parent hosts on a free port (bounded init timeout; it outlives any rank), with OMP_NUM_THREADS=1, and runs
`worker(rank, world, *args)`. Results
come back through files; a `PipelineError` is reported as the rank's one-line error and the process exits 1
at once (`os._exit`: a group with a dead peer must not be torn down politely, that can hang). The parent
enforces a wall-clock deadline and kills stragglers, so nothing outlives the call.

`variants_worker` runs several configs in one process group (one launch, many model variants) and returns
each variant's per-step stats and, if asked, the first step's gradients by parameter name.
`interleaved_worker` runs several configs step by step in turn (A/B benchmarking on a host whose speed drifts:
every variant sees the same drift) and records each variant's trace.
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankResult:
    rank: int
    exitcode: int | None  # None: killed at the deadline
    value: object = None
    error: str | None = None
    elapsed_s: float = 0.0


def run_or_die(rank: int, world: int, worker, args, out: Path, init) -> None:
    """`init()` (join the process group), `worker(rank, world, *args)`, its value saved to `out`, the group
    destroyed. On failure the error is saved and printed (a `PipelineError` as its one line) and the process exits
    1 at once: a group with a dead peer must not be torn down politely, that can hang. Shared with the tests'
    persistent ranks (tests/rank_pool.py)."""
    import torch.distributed as dist

    from pipeline.distributed.errors import PipelineError

    try:
        init()
        value = worker(rank, world, *args)
        torch.save({"value": value}, out)
        dist.destroy_process_group()
    except PipelineError as err:
        torch.save({"error": str(err)}, out)
        print(f"mhcpipe: error: {err}", file=sys.stderr, flush=True)
        os._exit(1)
    except BaseException as err:  # noqa: BLE001 - report anything, then die without teardown
        torch.save({"error": f"rank {rank}: {type(err).__name__}: {err}", "traceback": traceback.format_exc()}, out)
        print(traceback.format_exc(), file=sys.stderr, flush=True)
        os._exit(1)


def _entry(rank: int, world: int, port: int, init_timeout_s: float, worker, args, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    os.environ.pop("TRITON_INTERPRET", None)
    torch.set_num_threads(1)
    import torch.distributed as dist

    def init() -> None:
        # the parent hosts the store, so it outlives any rank (the strict transport's hang report reads it)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                              timeout=datetime.timedelta(seconds=init_timeout_s))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=init_timeout_s))

    run_or_die(rank, world, worker, args, Path(out_dir) / f"rank{rank}.pt", init)
    sys.stdout.flush()
    os._exit(0)


def launch(worker, world: int, args: tuple = (), *, timeout_s: float = 120.0, init_timeout_s: float = 30.0,
           grace_s: float = 30.0) -> list[RankResult]:
    """Run `worker` on `world` ranks. Like torchrun, once a rank has failed the rest get `grace_s` to finish
    (they should fail on their own within the configured P2P timeout) before they are killed."""
    import torch.multiprocessing as mp

    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False,  # noqa: F841 - lives
                          timeout=datetime.timedelta(seconds=init_timeout_s))           # as long as the ranks
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rt_launch_") as out_dir:
        procs = [ctx.Process(target=_entry, args=(r, world, port, init_timeout_s, worker, args, out_dir), daemon=False)
                 for r in range(world)]
        for p in procs:
            p.start()
        ended: dict[int, float] = {}
        deadline = started + timeout_s
        while len(ended) < world and time.monotonic() < deadline:
            for r, p in enumerate(procs):
                if r not in ended and not p.is_alive():
                    ended[r] = time.monotonic() - started
                    if p.exitcode != 0:
                        deadline = min(deadline, time.monotonic() + grace_s)
            time.sleep(0.02)
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
            p.join(5)
        results = []
        for r, p in enumerate(procs):
            path = Path(out_dir) / f"rank{r}.pt"
            blob = torch.load(path, weights_only=False) if path.exists() else {}
            results.append(RankResult(r, p.exitcode if r in ended else None, blob.get("value"), blob.get("error"),
                                      ended.get(r, timeout_s)))
    return results


def variants_worker(rank: int, world: int, cfg_dicts: list[dict], want_grads: bool, on_action=None,
                    count_activations: bool = False) -> list[dict]:
    """Train each config for its train.steps steps in this process group; one result dict per variant (saved
    activation bytes counted only with `count_activations`)."""
    from configs import parse_config
    from pipeline.runtime.gc_control import manual_gc
    from pipeline.runtime.train import RankRuntime, make_groups

    out = []
    cfgs = [parse_config(d) for d in cfg_dicts]
    # one collection regime for all variants, as pipeline.runtime.train.train_interleaved runs several configs: a full
    # pass per variant would walk torch's and the runtime's imports again each time
    with manual_gc(cfgs[0].train.gc_interval if cfgs else 0) as collect:
        for cfg in cfgs:
            groups = make_groups(cfg, rank, world, torch.device("cpu"))
            rt = RankRuntime(cfg, rank, torch.device("cpu"), groups=groups, on_action=on_action, record=False,
                             count_activations=count_activations)
            hist, grads = [], None
            rt.align_clocks()
            for k in range(cfg.train.steps):
                hist.append(rt.step(k))
                if k == 0 and want_grads:
                    grads = rt.grads()
                collect(k)
            rt.close()
            out.append({"stats": [vars(h) for h in hist], "grads": grads, "rc_block": rt.rc_block,
                        "num_stages": rt.plan.schedule.num_stages})
    return out


def interleaved_worker(rank: int, world: int, cfg_dicts: list[dict], trace_dirs: list[str]) -> list[list[dict]]:
    """pipeline.runtime.train.train_interleaved on CPU: the configs take turns step by step (A B B A ...), each
    variant's trace in its own folder; returns each variant's per-step stats."""
    from configs import parse_config
    from pipeline.runtime.train import train_interleaved

    history = train_interleaved([parse_config(d) for d in cfg_dicts], rank, world, torch.device("cpu"),
                                trace_dirs=[Path(d) for d in trace_dirs], log=lambda *a: None)
    return [[vars(s) for s in h] for h in history]
