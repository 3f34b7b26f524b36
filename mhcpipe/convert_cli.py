"""`mhcpipe convert`: any trace the commands read, written once as our JSON (version 2, spans as columns:
docs/traces.md §7) or our binary columns (`.npz`: §8), whole or only the steps asked for.

    mhcpipe convert TRACE -o OUT.json|OUT.npz [--steps A..B] [--which measured|predicted] [--rank R]

Reading a Kineto, Chrome or Nsight Systems trace of a long run is the slow part of every command on it; converted,
each later command reads columns (10^6 spans: 1.8 s from JSON, 0.9 s from .npz). `--steps A..B` keeps steps A to
B only, counted as in the file (step 0 is the first, a measured run's warm-up): a cut from a long run to analyse.
The file then records the step it starts at (meta `first_step`), and the analyses drop a warm-up step only from a
file that starts at step 0. From a .npz file, `--steps` on any command reads only those steps' spans.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from mhcpipe.analysis_cli import load_steps
from traces.analysis.step_select import parse_steps
from traces.formats.io import save_trace
from traces.trace import TraceError

OUT_SUFFIXES = (".json", ".npz")


def register(subparsers) -> None:
    c = subparsers.add_parser("convert", help="any trace written as our JSON or .npz (columns), whole or some steps",
                              description=__doc__.split("\n\n", 2)[2] + "\n\nexample:\n  mhcpipe convert "
                              "profile.json.gz -o run.npz --steps 3..7",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("trace", help="trace file (ours, Chrome/Perfetto, PyTorch profiler, Nsight Systems SQLite, nsys "
                   "CSV) or a folder of per-rank files")
    c.add_argument("-o", "--output", required=True, help="the converted trace: .json (our JSON) or .npz (binary "
                   "columns, for long runs)")
    c.add_argument("--steps", default=None, metavar="A..B", help="keep steps A to B (or one step: A), counted from 0 "
                   "as the file holds them (step 0: a measured run's warm-up)")
    c.add_argument("--which", choices=("measured", "predicted"), default=None,
                   help="which trace of a Chrome file that holds both (default measured)")
    c.add_argument("--rank", type=int, default=None, help="rank of a single-process file without rank info")
    c.set_defaults(func=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    suffix = Path(args.output).suffix.lower()
    if suffix not in OUT_SUFFIXES:
        raise TraceError(f"-o {args.output}: write .json (our JSON) or .npz (binary columns)")
    trace = load_steps(args.trace, rank=args.rank, which=args.which, steps=args.steps)
    out = save_trace(trace, args.output)
    what = "steps {}..{}".format(*parse_steps(args.steps)) if args.steps is not None else "the whole trace"
    size = out.stat().st_size / 1e6
    kind = "binary columns (.npz)" if suffix == ".npz" else "our JSON version 2"
    print(f"wrote {out}: {what}, {len(trace.spans):,} spans on {len(trace.ranks)} ranks ({size:.1f} MB, {kind})")
    return 0
