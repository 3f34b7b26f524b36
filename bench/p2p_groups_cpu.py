"""Benchmark: step time of the P2P channel groups (one process group per direction of each pipeline link, the
NCCL-safe design) against the shared group (one for all of a pipeline's P2P, the design before it), on 4 gloo
ranks, in one job: the two take turns step by step (A B B A ...), so both see the same drift of a shared
machine's speed. Plain gloo semantics on both sides (the strict transport is a test tool, not a speed path).

    .venv/bin/python bench/p2p_groups_cpu.py [--config tiny] [--schedule dualpipev] [--steps 24] [--warmup 4]
        [--out bench/results/p2p_groups_cpu.json]

Step time = the slowest rank's step (StepStats.step_time_s), median over the steps after the warm-up; also the
median of the per-step ratio channel/shared (each pair of steps ran next to each other).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs import load_config
from pipeline.launch.local import launch

VARIANTS = ("channel", "shared")


def worker(rank: int, world: int, cfg_dicts: list[dict]) -> list[list[float]]:
    import torch

    from configs import parse_config
    from pipeline.runtime.gc_control import manual_gc
    from pipeline.runtime.train import RankRuntime, make_groups

    cfgs = [parse_config(d) for d in cfg_dicts]
    runtimes = [RankRuntime(c, rank, torch.device("cpu"), groups=make_groups(c, rank, world, torch.device("cpu")),
                            record=False) for c in cfgs]
    times: list[list[float]] = [[] for _ in runtimes]
    with manual_gc(cfgs[0].train.gc_interval) as collect:
        for rt in runtimes:
            rt.align_clocks()
        for k in range(cfgs[0].train.steps):
            for i in (range(len(runtimes)) if k % 2 == 0 else reversed(range(len(runtimes)))):
                times[i].append(runtimes[i].step(k).step_time_s)
            collect(k)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--schedule", default=None, help="default: the config's")
    ap.add_argument("--residual-n", type=int, default=4)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "p2p_groups_cpu.json")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        print(f"p2p_groups_cpu: --steps {args.steps} must exceed --warmup {args.warmup}", file=sys.stderr)
        return 2
    base = load_config(args.config).model_dump()
    if args.schedule:
        base["parallel"]["schedule"] = args.schedule
    n = args.residual_n
    base["model"]["residual"] = {**base["model"]["residual"], "variant": "mhc" if n > 1 else "residual", "n": n}
    base["train"].update(steps=args.steps, comm_rules="backend", device="cpu")
    cfgs = []
    for v in VARIANTS:
        c = json.loads(json.dumps(base))
        c["parallel"]["p2p_groups"] = v
        cfgs.append(c)
    world = base["parallel"]["ranks"] * base["parallel"]["data_parallel"]
    results = launch(worker, world, (cfgs,), timeout_s=60 + 30 * args.steps)
    bad = [(r.rank, r.error) for r in results if r.exitcode != 0]
    if bad:
        print(f"p2p_groups_cpu: ranks failed: {bad}", file=sys.stderr)
        return 1
    times = results[0].value  # step_time_s is already the max over ranks
    steady = [t[args.warmup:] for t in times]
    med = {v: statistics.median(t) for v, t in zip(VARIANTS, steady)}
    ratios = [a / b for a, b in zip(steady[0], steady[1])]
    ratio = statistics.median(ratios)
    q = statistics.quantiles(ratios, n=4)
    print(f"{'variant':<10}{'median step ms':>16}")
    for v in VARIANTS:
        print(f"{v:<10}{med[v] * 1e3:>16.1f}")
    print(f"channel/shared per step pair: median {ratio:.3f} (IQR {q[0]:.3f}-{q[2]:.3f}), "
          f"{len(ratios)} pairs; {world} ranks on {os.cpu_count()} cores")
    out = {"config": args.config, "schedule": base["parallel"]["schedule"], "n": n, "ranks": world,
           "cores": os.cpu_count(), "steps": args.steps, "warmup": args.warmup, "host": platform.node(),
           "median_step_s": med, "ratio_channel_over_shared": ratio, "ratio_iqr": [q[0], q[2]],
           "step_times_s": dict(zip(VARIANTS, times)),
           "command": "bench/p2p_groups_cpu.py " + " ".join(sys.argv[1:])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
