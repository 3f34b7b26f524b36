"""`mhcpipe demo` (what `make demo` runs): draw and explain a DualPipe schedule.

It builds DualPipe with P=8 ranks and M=20 micro-batches, validates and simulates it with DeepSeek's unit
costs (F = I = W = 1, B = 2, F&B = 3), checks the bubble against schedules.md's formula and writes
`runs/demo/`: schedule.png, schedule.csv (torch format), predicted_trace.json (ours) and perfetto.json.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="draw and explain a DualPipe schedule into runs/demo/", description=__doc__)
    p.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=20)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from schedules import Durations, build, simulate
    from schedules.formulas import bubble_formula, peak_activation_bound
    from schedules.torch_csv import write_csv
    from traces.chrome import save_chrome
    from traces.plot import plot_schedule

    out = Path(args.out)
    started = time.perf_counter()
    d = Durations(F=1, I=1, W=1)
    print(f"[1/3] building DualPipe, P={args.ranks}, M={args.microbatches}; costs F=I=W=1, B=I+W=2, F&B=F+B=3")
    schedule = build("dualpipe", args.ranks, args.microbatches)
    print("[2/3] validating (counts, order, P2P pairing, deadlock freedom) and simulating")
    result = simulate(schedule, d, time_unit="cost units")
    name, value = bubble_formula(schedule, d)
    idle = sorted(set(result.idle.values()))
    print(f"      makespan {result.makespan:g} units; busy {sorted(set(result.busy.values()))} per rank; "
          f"idle {idle} per rank; formula {name} = {value:g}")
    print(f"      peak live activations per rank: {max(result.peak_activations.values())} chunks "
          f"(published bound PP+1 = {peak_activation_bound(schedule)})")
    print("[3/3] writing pictures and files")
    title = (f"DualPipe P={args.ranks}, M={args.microbatches} (F=I=W=1, B=2, F&B=3): makespan "
             f"{result.makespan:g}, idle {idle[0]:g} per rank")
    written = [plot_schedule(result.trace, out / "schedule.png", title=title),
               write_csv(schedule, out / "schedule.csv"),
               result.trace.save(out / "predicted_trace.json"),
               save_chrome(out / "perfetto.json", result.trace)]
    for path in written:
        print(f"      wrote {path}")
    print(f"demo done in {time.perf_counter() - started:.1f} s. How to read {out / 'schedule.png'}: one row per rank "
          "(rank 0 on top); orange = forward, green = backward, blue = weight-grad (W), darker tones for the "
          "direction entering at the last rank; a split cell with a thick border is one overlapped F&B step; numbers are micro-batch ids within their direction. Open perfetto.json "
          "in https://ui.perfetto.dev for the same timeline with P2P arrows.")
    return 0
