"""`mhcpipe convert`: any trace the commands read, written once as our JSON (version 2, spans as columns:
docs/traces.md §7), whole or only the steps asked for.

    mhcpipe convert TRACE -o OUT.json [--steps A..B] [--which measured|predicted] [--rank R]

Reading a Kineto, Chrome or Nsight Systems trace of a long run is the slow part of every command on it; converted,
each later command reads columns (10^6 spans: 1.8 s). `--steps A..B` keeps steps A to B only, counted as in the
file (step 0 is the first, a measured run's warm-up): a cut from a long run to analyse. The file then records the
step it starts at (meta `first_step`), and the analyses drop a warm-up step only from a file that starts at step 0.
"""
from __future__ import annotations

import argparse

from traces.analysis.step_select import parse_steps, select_steps
from traces.formats.io import load_trace


def register(subparsers) -> None:
    c = subparsers.add_parser("convert", help="any trace written as our JSON (columns), whole or some steps",
                              description=__doc__.split("\n\n", 2)[2] + "\n\nexample:\n  mhcpipe convert "
                              "profile.json.gz -o run.json --steps 3..7",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("trace", help="trace file (ours, Chrome/Perfetto, PyTorch profiler, Nsight Systems SQLite, nsys "
                   "CSV) or a folder of per-rank files")
    c.add_argument("-o", "--output", required=True, help="the converted trace (.json)")
    c.add_argument("--steps", default=None, metavar="A..B", help="keep steps A to B (or one step: A), counted from 0 "
                   "as the file holds them (step 0: a measured run's warm-up)")
    c.add_argument("--which", choices=("measured", "predicted"), default=None,
                   help="which trace of a Chrome file that holds both (default measured)")
    c.add_argument("--rank", type=int, default=None, help="rank of a single-process file without rank info")
    c.set_defaults(func=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    steps = parse_steps(args.steps) if args.steps is not None else None
    trace = load_trace(args.trace, rank=args.rank, which=args.which)
    if steps is not None:
        trace = select_steps(trace, *steps)
    out = trace.save(args.output)
    what = f"steps {steps[0]}..{steps[1]}" if steps else "the whole trace"
    size = out.stat().st_size / 1e6
    print(f"wrote {out}: {what}, {len(trace.spans):,} spans on {len(trace.ranks)} ranks ({size:.1f} MB, our JSON "
          "version 2)")
    return 0
