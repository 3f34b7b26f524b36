"""Where a CPU pipeline step's time goes: the model's own work, the executor around it, and gloo's P2P.

    .venv/bin/python bench/runtime_overhead_cpu.py [--config tiny] [--reps 30] [--messages 2000]
                                                   [--out bench/results/runtime_overhead_cpu.json]

Shape letters: T tokens of a micro-batch, n streams, C hidden. For n = 1 (plain residual) and n = 4 (mHC), per
pipeline rank of the config's DualPipeV layout, in one process and one thread, alternating (so both see the same
drift of a shared host's speed), CPU time (`time.thread_time`) per step, median after 4 warm-up repetitions:
* `modules`: the rank's stages run forward and backward over the step's micro-batches with nothing around them
  (`Stage.forward_steps` / `backward_steps` on pre-made inputs and output-grads): what any pipeline runtime
  running these modules has to spend;
* `executor`: the rank's real lowered action list (`Executor.run_step`) over a loopback transport (every receive
  a copy of a pre-made tensor, every send dropped): the same work plus the runtime's own bookkeeping (actions,
  hand-offs, weight-grad store, spans off).
`executor - modules` is the runtime's own cost, without communication. Then gloo's cost per P2P message of the
boundary size [T, n, C], measured by a two-process ping-pong (`ProcessGroup.send/recv`, each waited): CPU time
of the whole process (gloo's I/O thread included) per message and side, and the wall time per message. Compare
with bench/torch_dualpipev.py, which runs the whole pipeline against torch's ScheduleDualPipeV.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs import load_config, parse_config
from pipeline.launch.local import free_port


def rank_costs(cfg, rank: int, reps: int) -> dict:
    """CPU ms per step of rank `rank`: modules alone, and the executor over a loopback transport."""
    from pipeline.data import make_batch
    from pipeline.distributed.loopback import LoopbackTransport
    from pipeline.runtime.stage import ChunkRun
    from pipeline.runtime.train import RankRuntime

    rt = RankRuntime(cfg, rank, torch.device("cpu"), record=False)
    t, n, c = cfg.parallel.tokens_per_microbatch, cfg.model.residual.n, cfg.model.hidden
    loop = LoopbackTransport(rank, torch.device("cpu"), (t, n, c), rt.dtype, seed=cfg.train.seed)
    rt.use_transport(loop)
    batch = make_batch(cfg, 0)
    gen = torch.Generator().manual_seed(rank)
    m = cfg.parallel.microbatches
    xs = [torch.randn(t, n, c, generator=gen, dtype=rt.dtype) for _ in range(m)]
    gs = [torch.randn(t, n, c, generator=gen, dtype=rt.dtype) * 1e-2 for _ in range(m)]

    def executor():
        rt.optimizer.zero_grad(set_to_none=True)
        rt.executor.run_step(batch)

    def modules():
        rt.optimizer.zero_grad(set_to_none=True)
        for st in rt.stages.values():
            runs = []
            for mb in range(m):
                ids, labels = batch.microbatch(mb)
                run = ChunkRun(st.spec.stage, mb)
                for _ in st.forward_steps(run, ids if st.embed is not None else xs[mb],
                                          labels if st.head is not None else None, rt.env):
                    pass
                runs.append(run)
            for mb, run in enumerate(runs):
                for _ in st.backward_steps(run, None if st.head is not None else gs[mb], rt.env):
                    pass

    times: dict[str, list[float]] = {"modules": [], "executor": []}
    for k in range(reps + 4):
        order = (("modules", modules), ("executor", executor))
        order = order if k % 2 else order[::-1]
        for name, fn in order:
            c0 = time.thread_time()
            fn()
            if k >= 4:
                times[name].append(time.thread_time() - c0)
    return {name: statistics.median(v) * 1e3 for name, v in times.items()}


def _pingpong(rank: int, port: int, numel: int, messages: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    pg, buf = dist.group.WORLD, torch.ones(numel)
    for rep in range(2):  # the first pass warms the connection up
        dist.barrier()
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(messages):
            if rank == 0:
                pg.send([buf], 1, 0).wait()
                pg.recv([buf], 1, 0).wait()
            else:
                pg.recv([buf], 0, 0).wait()
                pg.send([buf], 0, 0).wait()
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    Path(out).with_suffix(f".{rank}").write_text(json.dumps({"cpu_us": cpu / (2 * messages) * 1e6,
                                                             "wall_us": wall / (2 * messages) * 1e6}))
    dist.barrier()
    dist.destroy_process_group()


def gloo_message_cost(numel: int, messages: int) -> dict:
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "pingpong")
        mp.start_processes(_pingpong, args=(free_port(), numel, messages, out), nprocs=2, start_method="spawn")
        sides = [json.loads(Path(out).with_suffix(f".{r}").read_text()) for r in (0, 1)]
    return {"bytes": numel * 4, "cpu_us_per_message_and_side": statistics.mean(s["cpu_us"] for s in sides),
            "wall_us_per_message": statistics.mean(s["wall_us"] for s in sides)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--messages", type=int, default=2000, help="ping-pong round trips per gloo measurement")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "runtime_overhead_cpu.json")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.messages < 1:
        ap.error("--reps and --messages must be >= 1")
    torch.set_num_threads(1)
    base = load_config(args.config).model_dump()
    base["parallel"]["schedule"] = "dualpipev"
    rows = []
    print(f"{'n':>2} {'rank':>4} {'modules ms':>11} {'executor ms':>12} {'own ms':>7} {'own %':>6}")
    for n in (1, 4):
        d = json.loads(json.dumps(base))
        d["model"]["residual"] = {"variant": "mhc" if n > 1 else "residual", "n": n}
        cfg = parse_config(d)
        for rank in range(cfg.parallel.ranks):
            r = rank_costs(cfg, rank, args.reps)
            own = r["executor"] - r["modules"]
            rows.append({"n": n, "rank": rank, "modules_ms": r["modules"], "executor_ms": r["executor"],
                         "executor_own_ms": own})
            print(f"{n:>2} {rank:>4} {r['modules']:>11.1f} {r['executor']:>12.1f} {own:>7.1f} "
                  f"{100 * own / r['executor']:>5.1f}%", flush=True)
    par = base["parallel"]
    msgs = []
    for n in (1, 4):
        numel = par["microbatch_size"] * par["seq_len"] * n * base["model"]["hidden"]
        g = gloo_message_cost(numel, args.messages)
        msgs.append({"n": n, **g})
        print(f"gloo P2P, n={n} ({g['bytes'] // 1024} KiB): {g['cpu_us_per_message_and_side']:.0f} us CPU per "
              f"message and side, {g['wall_us_per_message']:.0f} us wall per message", flush=True)
    totals = {n: {k: sum(r[k] for r in rows if r["n"] == n) for k in ("modules_ms", "executor_ms")} for n in (1, 4)}
    for n, t in totals.items():
        print(f"n={n}: all ranks, modules {t['modules_ms']:.1f} ms, executor {t['executor_ms']:.1f} ms, the "
              f"runtime's own {t['executor_ms'] - t['modules_ms']:.1f} ms per step")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "config": args.config, "schedule": "dualpipev", "reps": args.reps, "messages": args.messages,
        "what": "CPU ms per step (thread time, one thread): modules alone vs the executor over a loopback "
                "transport; gloo P2P cost per message of the boundary size (two-process ping-pong)",
        "ranks": rows, "totals": {str(k): v for k, v in totals.items()}, "gloo_p2p": msgs,
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "cpus": os.cpu_count()}},
        indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
