"""`mhcpipe schedule`: generate, validate, simulate, print and draw a pipeline schedule."""
from __future__ import annotations

import argparse
from pathlib import Path

from schedules.build import build
from schedules.registry import names
from schedules.durations import Durations
from schedules.formulas import bubble_formula, peak_activation_bound
from schedules.ir import Schedule
from schedules.simulate import SimResult, simulate

OUTPUT_SUFFIXES = (".png", ".svg", ".json", ".csv")
MAX_PRINTED_ACTIONS = 400  # per-rank order lines get unreadable beyond this


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("schedule", help="generate, validate, simulate and draw a pipeline schedule",
                       description=__doc__)
    p.add_argument("--kind", required=True, choices=names(), help="schedule generator")
    p.add_argument("--ranks", type=int, required=True, help="pipeline ranks P")
    p.add_argument("--microbatches", type=int, required=True, help="micro-batches M per iteration")
    p.add_argument("--cost", default="F=1,I=1,W=1",
                   help="durations per action kind, e.g. F=1,B=2,W=1 (B = I + W and F&B = F + B by default)")
    p.add_argument("--p2p", default=None, metavar="LATENCY[,BYTES_PER_UNIT,MESSAGE_BYTES]",
                   help="P2P alpha-beta cost, e.g. 0.1 or 0.1,50e3,84e6 (default: free)")
    p.add_argument("--comms", action="store_true", help="print and write the lowered schedule (with SEND/RECV)")
    p.add_argument("-o", "--output", action="append", default=[], metavar="FILE",
                   help="write .png/.svg (picture), .csv (torch format), .json (our IR); repeatable")
    p.add_argument("--trace", metavar="FILE.json", help="write the simulated trace (our JSON format)")
    p.add_argument("--perfetto", metavar="FILE.json", help="write the simulated trace as Chrome/Perfetto JSON")
    p.set_defaults(func=run)


def _durations(args: argparse.Namespace) -> Durations:
    d = Durations.parse(args.cost)
    if args.p2p:
        parts = [x for x in args.p2p.split(",") if x]
        try:
            values = [float(x) for x in parts]
        except ValueError:
            raise ValueError(f"--p2p: {args.p2p!r} is not LATENCY[,BYTES_PER_UNIT,MESSAGE_BYTES]") from None
        if len(values) not in (1, 3) or min(values) < 0:
            raise ValueError("--p2p takes LATENCY or LATENCY,BYTES_PER_UNIT,MESSAGE_BYTES (all >= 0)")
        d = d.model_copy(update={"p2p_latency": values[0]})
        if len(values) == 3:
            if values[1] == 0:
                raise ValueError("--p2p: bandwidth must be > 0")
            d = d.model_copy(update={"p2p_bandwidth": values[1], "message_bytes": values[2]})
    return d


def report(schedule: Schedule, result: SimResult, d: Durations) -> str:
    lines = []
    total = sum(len(a) for a in schedule.actions)
    if total <= MAX_PRINTED_ACTIONS * schedule.num_ranks and max(map(len, schedule.actions)) <= MAX_PRINTED_ACTIONS:
        lines.append(schedule.describe())
    else:
        lines.append(f"{schedule.kind}: {schedule.num_ranks} ranks, {schedule.num_microbatches} micro-batches "
                     f"({total} actions; per-rank order omitted, write it with -o FILE.csv)")
    lines.append("")
    lines.append(result.summary())
    formula = bubble_formula(schedule, d)
    idle = sorted(set(round(v, 9) for v in result.idle.values()))
    if formula:
        lines.append(f"bubble per rank: simulated {', '.join(f'{v:g}' for v in idle)}; "
                     f"formula {formula[0]} = {formula[1]:g} (exact for uniform costs and free P2P)")
    bound = peak_activation_bound(schedule)
    if bound is not None:
        lines.append(f"peak live activations: {max(result.peak_activations.values())} chunks "
                     f"(published bound {bound})")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from schedules.ir_json import save_schedule
    from schedules.lowering import lower_comms
    from schedules.torch_csv import write_csv

    for out in args.output:
        if Path(out).suffix.lower() not in OUTPUT_SUFFIXES:
            raise ValueError(f"-o {out}: unknown output type; use one of {', '.join(OUTPUT_SUFFIXES)}")
    d = _durations(args)
    schedule = build(args.kind, args.ranks, args.microbatches)
    result = simulate(schedule, d, time_unit="cost units")
    shown = lower_comms(schedule) if args.comms else schedule
    print(report(shown, result, d))
    for out in args.output:
        suffix = Path(out).suffix.lower()
        if suffix in (".png", ".svg"):
            from traces.drawing.plot import plot_schedule

            title = (f"{schedule.kind}, P={schedule.num_ranks}, M={schedule.num_microbatches}, costs {args.cost}: "
                     f"makespan {result.makespan:g}, bubble {100 * result.bubble_fraction:.1f}%")
            plot_schedule(result.trace, out, title=title)
        elif suffix == ".csv":
            write_csv(shown, out)
        else:
            save_schedule(shown, out)
        print(f"wrote {out}")
    if args.trace:
        result.trace.save(args.trace)
        print(f"wrote {args.trace}")
    if args.perfetto:
        from traces.formats.chrome import save_chrome

        save_chrome(args.perfetto, result.trace)
        print(f"wrote {args.perfetto}")
    return 0
