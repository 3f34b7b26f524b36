"""Benchmark: what bf16 and stage-aligned recompute change for a user's model on CPU ranks: step time, activation
memory (saved tensors, counted) and peak RSS, in one job whose variants take turns step by step (A B C D D C B A
...), so all see the same drift of a shared machine's speed.

The model: `examples/plain_transformer.py:build` with `--residual mhc:4` at hidden `--hidden` (default 256), SwiGLU
4x, 8 blocks; DualPipeV, M=8 micro-batches of 2 x 32 tokens. Variants: fp32; bf16 (autocast, fp32 parameters:
pipeline.user_model.amp); fp32 with recompute 'auto' (each stage's blocks recomputed as one unit in its
backward: pipeline.runtime.user_stage.recompute_units); bf16 with it.

    .venv/bin/python bench/user_bf16_recompute_cpu.py [--pp 4] [--hidden 256] [--steps 10] [--warmup 2]
        [--out bench/results/user_bf16_recompute_cpu.json]

Step time: the slowest rank's (StepStats.step_time_s), median after the warm-up; activation memory: the largest
rank's peak of saved activation bytes in a step (StepStats.peak_act_bytes). 4 ranks time-slice 2 cores here;
--pp 2 gives each rank a core.
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

VARIANTS = {"fp32": ("float32", "off"), "bf16": ("bfloat16", "off"), "fp32+recompute": ("float32", "auto"),
            "bf16+recompute": ("bfloat16", "auto")}


def worker(rank: int, world: int, cfg_dict: dict, hidden: int) -> dict:
    import warnings

    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    import plain_transformer

    from configs import parse_config
    from pipeline.launch.user_config import user_config
    from pipeline.model import seeded
    from pipeline.runtime.gc_control import manual_gc
    from pipeline.runtime.train import RankRuntime, make_groups

    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")  # nn.RMSNorm under bf16
    base = parse_config(cfg_dict)
    runtimes = []
    for dtype, rc in VARIANTS.values():
        data = base.model_dump()
        data["train"]["dtype"] = dtype
        data["recompute"] = {"mode": rc}
        cfg = parse_config(data)
        with seeded(cfg.train.seed, "user-model"):
            model = plain_transformer.build("mhc:4", cfg.parallel.seq_len, hidden, 4 * hidden)
        cfg = user_config(cfg, model)
        rt = RankRuntime(cfg, rank, torch.device("cpu"), groups=make_groups(cfg, rank, world, torch.device("cpu")),
                         record=False, count_activations=True, model=model)
        runtimes.append(rt)
    rows: list[list[dict]] = [[] for _ in runtimes]
    with manual_gc(base.train.gc_interval) as collect:
        for rt in runtimes:
            rt.align_clocks()
        for k in range(base.train.steps):
            for i in (range(len(runtimes)) if k % 2 == 0 else reversed(range(len(runtimes)))):
                s = runtimes[i].step(k)
                rows[i].append({"step_s": s.step_time_s, "act": s.peak_act_bytes, "loss": s.loss})
            collect(k)
    for rt in runtimes:
        rt.close()
    import resource

    return {"rows": rows, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "user_bf16_recompute_cpu.json")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        print(f"user_bf16_recompute_cpu: --steps {args.steps} must exceed --warmup {args.warmup}", file=sys.stderr)
        return 2
    base = load_config("tiny", {"parallel": {"ranks": args.pp, "schedule": "dualpipev"},
                                "train": {"steps": args.steps, "comm_rules": "backend", "device": "cpu",
                                          "timeout_s": 300}})
    results = launch(worker, args.pp, (base.model_dump(), args.hidden), timeout_s=300 + 60 * args.steps)
    bad = [(r.rank, r.error) for r in results if r.exitcode != 0]
    if bad:
        print(f"user_bf16_recompute_cpu: ranks failed: {bad}", file=sys.stderr)
        return 1
    rows = results[0].value["rows"]  # step time and activation peak are already the max over ranks
    summary = {}
    for name, r in zip(VARIANTS, rows):
        steady = r[args.warmup:]
        summary[name] = {"median_step_s": statistics.median(x["step_s"] for x in steady),
                         "peak_act_bytes": max(x["act"] for x in steady), "loss_last": r[-1]["loss"]}
    fp32 = summary["fp32"]
    print(f"{'variant':<16}{'median step ms':>16}{'/ fp32':>8}{'activations MiB':>17}{'/ fp32':>8}{'last loss':>11}")
    for name, s in summary.items():
        print(f"{name:<16}{s['median_step_s'] * 1e3:>16.1f}{s['median_step_s'] / fp32['median_step_s']:>8.2f}"
              f"{s['peak_act_bytes'] / 2**20:>17.1f}{s['peak_act_bytes'] / fp32['peak_act_bytes']:>8.2f}"
              f"{s['loss_last']:>11.4f}")
    rss = max(r.value["peak_rss"] for r in results)
    print(f"DualPipeV, {args.pp} ranks on {os.cpu_count()} cores, hidden {args.hidden}, {args.steps - args.warmup} "
          f"steps after {args.warmup} warm-up; peak RSS of the largest rank (all four variants) {rss / 2**30:.2f} GiB")
    out = {"schedule": "dualpipev", "ranks": args.pp, "cores": os.cpu_count(), "hidden": args.hidden,
           "steps": args.steps, "warmup": args.warmup, "host": platform.node(), "summary": summary,
           "rows": dict(zip(VARIANTS, rows)), "command": "bench/user_bf16_recompute_cpu.py " + " ".join(sys.argv[1:])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
