"""`mhcpipe critical-path`, `mhcpipe whatif` and `mhcpipe overlap`: which ops set the step time, what a faster
one would gain, and how much communication runs under compute.

    mhcpipe critical-path TRACE [--step K] [--json OUT] [--markdown OUT]
    mhcpipe whatif TRACE --scale comm=0.5 --scale mhc=0.7 [--baseline BASE] [--json OUT]
    mhcpipe overlap TRACE [--json OUT]

TRACE is any trace `traces.formats.io.load_trace` reads (our JSON, Chrome/Perfetto, PyTorch profiler, Nsight Systems
SQLite, nsys CSV) or a folder of per-rank files; critical-path and whatif need op names of traces.md §5 (e.g.
F/s3/mb7). A measured trace's first step (warm-up) is left out when it has more than one (`--keep-warmup`).
A prediction records transfers, not where receives were posted: its replay takes each receive as posted by the
receiver's last op before the transfer, which can only delay a re-timed step (in Python, pass the lowered
schedule: traces.analysis.whatif.whatif(trace, scales, schedule=...) then equals schedules.simulate).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from traces.analysis.critical_path import critical_path
from traces.formats.io import read_columns
from traces.analysis.matching import drop_warmup_step
from traces.analysis.overlap_stats import overlap_stats
from traces.analysis.step_pool import MIN_STEPS
from traces.analysis.path_report import overlap_sections, path_sections, to_markdown, to_text, whatif_sections
from traces.analysis.step_select import file_trace, parse_steps, select_file_steps, select_steps
from traces.formats.npz import ColumnFile
from traces.trace import Trace
from traces.analysis.whatif import SCALE_HELP, parse_scales, whatif


DESCRIPTIONS = {
    "critical-path": "The chain of ops and transfers that sets one step's time, across ranks: where its time goes, "
                     "the gaps, the slack of every op.\n\nexample:\n  mhcpipe critical-path runs/x --markdown "
                     "path.md",
    "whatif": "Replay a measured trace with some ops faster or slower and predict the step.\n\nexample:\n  mhcpipe "
              "whatif runs/x --scale comm=0.5 --scale mhc=0 [--baseline runs/base]",
    "overlap": "How much of each rank's communication runs under its compute, per rank, stream and op.\n\n"
               "example:\n  mhcpipe overlap runs/x --json overlap.json",
}


def register(subparsers) -> None:
    c = subparsers.add_parser("critical-path", help="the chain of ops and transfers that sets a step's time, "
                              "across ranks", description=DESCRIPTIONS["critical-path"],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(c)
    c.add_argument("--step", type=int, default=None, help="step to analyse (default: the one with the median "
                   "makespan; counted from 0 after the dropped warm-up step)")
    c.add_argument("--markdown", dest="md_out", help="write the tables as Markdown here")
    c.add_argument("--rows", type=int, default=40, help="ops of the path listed in the table (JSON: all)")
    c.set_defaults(func=run_critical_path)

    w = subparsers.add_parser("whatif", help="replay a measured trace with some ops faster or slower",
                              description=DESCRIPTIONS["whatif"] + "\n\nKINDS for --scale (factor >= 0; 0 removes "
                              "the time):\n" + SCALE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(w)
    w.add_argument("--scale", action="append", default=[], metavar="KIND=FACTOR", required=True,
                   help="scale the time of KIND by FACTOR (repeat for several kinds); KIND as listed above")
    w.add_argument("--baseline", help="a trace of the same schedule without mHC: `mhc` then scales each op's "
                   "measured A/B share instead of the recorded mHC kernel parts only")
    jobs_arg(w, "replayed")
    w.set_defaults(func=run_whatif)

    o = subparsers.add_parser("overlap", help="communication under compute per rank and stream (ours, nsys, "
                              "Kineto)", description=DESCRIPTIONS["overlap"],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    o.add_argument("trace", help="trace file or folder of per-rank files")
    o.add_argument("--json", dest="json_out", help="write the result as JSON here")
    o.add_argument("--rank", type=int, default=None, help="rank of a single-process file without rank info")
    _steps_arg(o)
    o.set_defaults(func=run_overlap)


def jobs_arg(p: argparse.ArgumentParser, what: str) -> None:
    """--jobs for a command whose steps are analysed one by one (traces.analysis.step_pool). Workers are forked:
    each holds its own copy of the pages of the trace it reads, so memory grows with them."""
    p.add_argument("--jobs", type=int, default=None, metavar="N", help=f"processes the steps are {what} in "
                   "(default: every CPU this process may use, one when the memory available is under twice what it "
                   f"holds; runs of fewer than {MIN_STEPS} steps use one); each worker copies the part of the trace "
                   "it reads; the result does not depend on it")


def check_jobs(jobs: int | None) -> None:
    """Before the trace is read: a bad --jobs is one line at once, not after minutes of loading."""
    if jobs is not None and jobs < 1:
        raise ValueError(f"--jobs {jobs}: give a number of processes >= 1")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="trace file or folder of per-rank files (names as in traces.md §5)")
    p.add_argument("--json", dest="json_out", help="write the result as JSON here")
    p.add_argument("--which", choices=("measured", "predicted"), default=None,
                   help="which trace of a Chrome file that holds both (default measured)")
    p.add_argument("--keep-warmup", action="store_true", help="keep a measured trace's first step")
    p.add_argument("--rank", type=int, default=None, help="rank of a single-process file without rank info")
    _steps_arg(p)


STEPS_HELP = ("analyse steps A to B only (or one step: A), counted from 0 as the file holds them (step 0: a measured "
              "run's warm-up), as `mhcpipe convert --steps` cuts them: a long run's trace in seconds")


def _steps_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", default=None, metavar="A..B", help=STEPS_HELP)


def load_steps(path: str, rank: int | None = None, which: str | None = None, steps: str | None = None) -> Trace:
    """The trace at `path`, only its steps A..B when `steps` is given (a bad range refused before the file is
    read). From our .npz or JSON (version 2) the steps are found on the columns, and Span objects are made only when
    an analysis asks for them (traces.trace.Trace.of_rows)."""
    span = parse_steps(steps) if steps is not None else None
    read = read_columns(path, rank=rank, which=which)
    if isinstance(read, ColumnFile):
        return select_file_steps(read, *span) if span is not None else file_trace(read)
    return select_steps(read, *span) if span is not None else read


def load_for_analysis(path: str, which: str | None = None, rank: int | None = None,
                      keep_warmup: bool = False, steps: str | None = None) -> Trace:
    """The trace at `path`, cut to `steps` (A..B) when given, its warm-up step dropped unless `keep_warmup` (a cut
    that starts after step 0 has none: traces.analysis.matching.drop_warmup_step)."""
    trace = load_steps(path, rank, which, steps)
    if trace.meta.get("source") not in ("predicted", "simulated") and not keep_warmup:
        trace = drop_warmup_step(trace)
    return trace


def _write_json(path: str, data) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data, indent=1, default=str))


def run_critical_path(args: argparse.Namespace) -> int:
    trace = load_for_analysis(args.trace, args.which, args.rank, args.keep_warmup, args.steps)
    cp = critical_path(trace, step=args.step).to_dict()
    secs = path_sections(cp, max_rows=max(args.rows, 2))
    sys.stdout.write(to_text(secs, cp["notes"]))
    if args.json_out:
        _write_json(args.json_out, cp)
    if args.md_out:
        Path(args.md_out).write_text(to_markdown(secs, cp["notes"]))
    return 0


def run_whatif(args: argparse.Namespace) -> int:
    scales = parse_scales(args.scale)
    check_jobs(args.jobs)
    trace = load_for_analysis(args.trace, args.which, args.rank, args.keep_warmup, args.steps)
    base = load_for_analysis(args.baseline, args.which, None, args.keep_warmup) if args.baseline else None
    res = whatif(trace, scales, baseline=base, baseline_name=args.baseline or "", jobs=args.jobs).to_dict()
    sys.stdout.write(to_text(whatif_sections(res), res["notes"]))
    if args.json_out:
        _write_json(args.json_out, res)
    return 0


def run_overlap(args: argparse.Namespace) -> int:
    res = overlap_stats(load_steps(args.trace, args.rank, steps=args.steps)).to_dict()
    sys.stdout.write(to_text(overlap_sections(res), res["notes"]))
    if args.json_out:
        _write_json(args.json_out, res)
    return 0
