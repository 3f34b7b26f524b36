"""Benchmark: real pipeline steps on 4 CPU ranks (gloo), tiny config: 1F1B vs DualPipeV vs ZB1P, baseline
residual (n=1) vs mHC (n=4), the measured mHC overhead, and recompute's activation memory against Table 3.

    .venv/bin/python bench/pipeline_cpu.py [--steps 6] [--warmup 2] [--out bench/results/pipeline_cpu.json]

Step time = median over the steps after the warm-up of the slowest rank's step. Peak activation memory = max
over ranks of bytes saved for backward. The Table 3 prediction per chunk is (n+3)C per sub-layer and token
without recompute and C per sub-layer + nC per recompute block with it (mhc.md §5), times the peak number of
live chunks on a rank (schedules.peak_live_activations).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs import load_config, recompute_block_size
from pipeline.launch.local import launch, variants_worker
from schedules import build, peak_live_activations

SCHEDULES = ("1f1b", "dualpipev", "zb1p")


def variant(base: dict, n: int, recompute: str, steps: int) -> dict:
    cfg = json.loads(json.dumps(base))
    cfg["model"]["residual"] = {"variant": "mhc" if n > 1 else "residual", "n": n}
    cfg["recompute"] = {"mode": recompute}
    cfg["train"]["steps"] = steps
    return cfg


def predicted_saving(cfg, schedule) -> float:
    """Table 3: bytes per rank that recompute should free at the activation peak (fp32)."""
    mc, par = cfg.model, cfg.parallel
    n, c, t = mc.residual.n, mc.hidden, par.tokens_per_microbatch
    stages = schedule.num_stages
    sub = 2 * mc.num_blocks // stages
    lr = recompute_block_size(cfg.recompute.model_copy(update={"mode": "auto"}), sub, n)  # as the runtime cuts it
    per_chunk = (sub * (n + 3) - (sub + n * math.ceil(sub / lr))) * c * t * 4
    transient = ((lr - 1) * n + 2 * lr) * c * t * 4  # one block rebuilt during its backward (x_l, H_pre x_l, norm)
    return per_chunk * max(peak_live_activations(schedule).values()), lr, transient


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "pipeline_cpu.json")
    args = ap.parse_args()
    base = load_config(args.config).model_dump()
    ranks = base["parallel"]["ranks"]
    rows = []
    for kind in SCHEDULES:
        base["parallel"]["schedule"] = kind
        variants = [variant(base, 1, "off", args.steps), variant(base, 4, "off", args.steps),
                    variant(base, 4, "auto", args.steps)]
        t0 = time.perf_counter()
        res = launch(variants_worker, ranks, (variants, False, None, True), timeout_s=900)
        bad = [(r.rank, r.error) for r in res if r.exitcode != 0]
        if bad:
            print(f"{kind}: failed {bad}", file=sys.stderr)
            return 1
        stats = [res[0].value[i]["stats"][args.warmup:] for i in range(len(variants))]
        med = [statistics.median(s["step_time_s"] for s in st) for st in stats]
        act = [max(s["peak_act_bytes"] for s in st) for st in stats]
        cfg4 = load_config(args.config, {"parallel": {"schedule": kind}})
        sched = build(kind, ranks, base["parallel"]["microbatches"])
        pred, lr, transient = predicted_saving(cfg4, sched)
        rows.append({"schedule": kind, "ranks": ranks, "microbatches": base["parallel"]["microbatches"],
                     "tokens_per_step": cfg4.parallel.tokens_per_microbatch * cfg4.parallel.microbatches,
                     "step_s_n1": med[0], "step_s_n4": med[1], "step_s_n4_recompute": med[2],
                     "mhc_overhead_pct": 100 * (med[1] / med[0] - 1),
                     "recompute_overhead_pct": 100 * (med[2] / med[1] - 1),
                     "peak_act_bytes_n1": act[0], "peak_act_bytes_n4": act[1], "peak_act_bytes_n4_recompute": act[2],
                     "recompute_saving_bytes": act[1] - act[2], "table3_predicted_saving_bytes": pred,
                     "table3_transient_block_bytes": transient,
                     "recompute_block": lr, "launch_wall_s": time.perf_counter() - t0,
                     "losses_n4": [s["loss"] for s in res[0].value[1]["stats"]]})
    print(f"{'schedule':<10} {'n=1 ms':>8} {'n=4 ms':>8} {'mHC ovh':>8} {'n=4+rc ms':>10} "
          f"{'act n4 KiB':>11} {'act rc KiB':>11} {'saved KiB':>10} {'Table3 KiB':>11} {'-transient':>11}")
    for r in rows:
        print(f"{r['schedule']:<10} {r['step_s_n1'] * 1e3:>8.1f} {r['step_s_n4'] * 1e3:>8.1f} "
              f"{r['mhc_overhead_pct']:>7.1f}% {r['step_s_n4_recompute'] * 1e3:>10.1f} "
              f"{r['peak_act_bytes_n4'] / 1024:>11.1f} {r['peak_act_bytes_n4_recompute'] / 1024:>11.1f} "
              f"{r['recompute_saving_bytes'] / 1024:>10.1f} {r['table3_predicted_saving_bytes'] / 1024:>11.1f} "
              f"{(r['table3_predicted_saving_bytes'] - r['table3_transient_block_bytes']) / 1024:>11.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    import torch

    args.out.write_text(json.dumps({"config": args.config, "steps": args.steps, "warmup": args.warmup,
                                    "machine": {"platform": platform.platform(), "torch": torch.__version__,
                                                "cpus": __import__("os").cpu_count()},
                                    "results": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
