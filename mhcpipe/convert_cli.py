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
import re

from traces.analysis.step_select import steps_of
from traces.formats.io import load_trace
from traces.trace import Trace, TraceError

_RANGE = re.compile(r"^(\d+)(?:\.\.(\d+))?$")


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


def parse_steps(text: str) -> tuple[int, int]:
    m = _RANGE.match(text.strip())
    if m is None:
        raise ValueError(f"--steps {text!r}: write A..B (steps A to B, e.g. 3..7) or one step A")
    a = int(m.group(1))
    b = int(m.group(2)) if m.group(2) is not None else a
    if b < a:
        raise ValueError(f"--steps {text!r}: the last step {b} comes before the first {a}; write {b}..{a}")
    return a, b


def select_steps(trace: Trace, first: int, last: int) -> Trace:
    """Steps `first` to `last` of `trace` (steps counted as traces.analysis.step_select counts them, warm-up
    included), their spans in the file's order; meta `first_step` records where the cut starts."""
    info = steps_of(trace)
    have = info.steps
    missing = [k for k in range(first, last + 1) if k not in info.spans]
    if missing:
        raise TraceError(f"--steps {first}..{last}: the trace holds steps {have[0]}..{have[-1]} (counted from 0, "
                         f"warm-up included); step {missing[0]} is not among them")
    keep = sorted(i for k in range(first, last + 1) for i in info.spans[k])
    offset = int(trace.meta.get("first_step", 0))
    meta = {**trace.meta, "first_step": offset + first, "steps": last - first + 1}
    return Trace(spans=[trace.spans[i] for i in keep], meta=meta)


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
