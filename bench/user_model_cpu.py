"""Benchmark: step time of a user's model through the pipeline beside the built-in model of the same size, on gloo
ranks, in one job whose variants take turns step by step (A B C C B A ...), so all see the same drift of a
shared machine's speed:

* builtin: `configs/tiny.yaml` (8 blocks, C=64, 4 heads x 16, SwiGLU 128, mHC n=4, our kernels);
* hc: `examples/hc_model.py:build`, the same sizes written with the hyper-connections library (its mHC, einops
  layout changes, a hash-routed MLP with 4 experts in the last block);
* hc-serial: the same with its F&B pairs' halves one after the other (`--no-overlap`; hc interleaves them at its
  blocks' attention / MLP phases);
* plain-mhc: `examples/plain_transformer.py:build` with `--residual mhc:4` (the same sizes, our MHCSublayer around
  a user's sub-layers).

    .venv/bin/python bench/user_model_cpu.py [--pp 4] [--schedule dualpipev] [--steps 16] [--warmup 3]
        [--out bench/results/user_model_cpu.json]

Step time = the slowest rank's step (StepStats.step_time_s), median over the steps after the warm-up, and the
median per-step ratio to builtin. 4 ranks time-slice 2 cores here; --pp 2 gives each rank a core.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from configs import load_config  # noqa: E402
from pipeline.launch.local import launch  # noqa: E402

# name -> (builder, residual, F&B overlap) of a user model; None: the built-in model
VARIANTS = {"builtin": None, "hc": (f"{ROOT}/examples/hc_model.py:build", None, True),
            "hc-serial": (f"{ROOT}/examples/hc_model.py:build", None, False),
            "plain-mhc": (f"{ROOT}/examples/plain_transformer.py:build", "mhc:4", True)}


def worker(rank: int, world: int, cfg_dict: dict) -> dict:
    import torch

    from configs import parse_config
    from pipeline.launch.user_config import build_model, load_builder, user_config
    from pipeline.runtime.gc_control import manual_gc
    from pipeline.runtime.train import RankRuntime, make_groups

    base = parse_config(cfg_dict)
    runtimes, params = [], {}
    for name, user in VARIANTS.items():
        cfg, model = base, None
        if user is not None:
            model = build_model(load_builder(user[0]), base.train.seed, user[1], base.parallel.seq_len)
            cfg = user_config(base, model)
            cfg = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"overlap": user[2]})})
        groups = make_groups(cfg, rank, world, torch.device("cpu"))
        rt = RankRuntime(cfg, rank, torch.device("cpu"), groups=groups, record=False, model=model)
        runtimes.append(rt)
        params[name] = sum(p.numel() for p in rt.params.values())
    times: list[list[float]] = [[] for _ in runtimes]
    with manual_gc(base.train.gc_interval) as collect:
        for rt in runtimes:
            rt.align_clocks()
        for k in range(base.train.steps):
            for i in (range(len(runtimes)) if k % 2 == 0 else reversed(range(len(runtimes)))):
                times[i].append(runtimes[i].step(k).step_time_s)
            collect(k)
    for rt in runtimes:
        rt.close()
    return {"times": times, "params": params}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--schedule", default="dualpipev")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "user_model_cpu.json")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        print(f"user_model_cpu: --steps {args.steps} must exceed --warmup {args.warmup}", file=sys.stderr)
        return 2
    base = load_config("tiny", {"parallel": {"ranks": args.pp, "schedule": args.schedule},
                                "train": {"steps": args.steps, "comm_rules": "backend", "device": "cpu"}})
    results = launch(worker, args.pp, (base.model_dump(),), timeout_s=120 + 30 * args.steps)
    bad = [(r.rank, r.error) for r in results if r.exitcode != 0]
    if bad:
        print(f"user_model_cpu: ranks failed: {bad}", file=sys.stderr)
        return 1
    times = results[0].value["times"]  # step_time_s is already the max over ranks
    params = {name: sum(r.value["params"][name] for r in results) for name in VARIANTS}  # DualPipe: copies counted
    steady = {name: t[args.warmup:] for name, t in zip(VARIANTS, times)}
    med = {name: statistics.median(t) for name, t in steady.items()}
    ratio = {name: statistics.median(a / b for a, b in zip(t, steady["builtin"])) for name, t in steady.items()}
    print(f"{'variant':<11}{'parameters':>12}{'median step ms':>16}{'/ builtin':>11}")
    for name in VARIANTS:
        print(f"{name:<11}{params[name]:>12,}{med[name] * 1e3:>16.1f}{ratio[name]:>11.2f}")
    print(f"{args.schedule}, {args.pp} ranks on {os.cpu_count()} cores, {args.steps - args.warmup} steps after "
          f"{args.warmup} warm-up")
    out = {"schedule": args.schedule, "ranks": args.pp, "cores": os.cpu_count(), "steps": args.steps,
           "warmup": args.warmup, "host": platform.node(), "parameters": params, "median_step_s": med,
           "median_ratio_to_builtin": ratio, "step_times_s": dict(zip(VARIANTS, times)),
           "command": "bench/user_model_cpu.py " + " ".join(sys.argv[1:])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
