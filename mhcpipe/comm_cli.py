"""`mhcpipe check-comm`: replay a measured trace's communication under NCCL's rules (per-group FIFO order,
rendezvous sends, positional matching, host waits) and report deadlocks, order mismatches and unmatched ops.

    mhcpipe check-comm TRACE [--comm-rules nccl|nccl-pair|both] [--json OUT]
    mhcpipe check-comm FR_DIR [--json OUT]
    mhcpipe check-comm --cuda DIR [--blocking-wait] [--json OUT]

example: mhcpipe check-comm runs/x/trace.json --comm-rules both

TRACE is a trace of ours recorded by `mhcpipe run ... --trace-dir DIR` (or that folder). `--comm-rules` takes the
values of the run's switch (train.comm_rules, traces/nccl_rules.py): `nccl` (the group view) queues everything a
rank posts on one process group in one FIFO; `nccl-pair` (the pair view) gives P2P ops one queue per peer
(two-rank communicators). Prints `ok: N ops in B batches on G groups (V view)` per view and exits 0, or the
problems (first line a summary per view) and exits 1; bad input exits 2.

FR_DIR is a folder of torch Flight Recorder dumps (`rank_<r>` pickles, written by NCCL's watchdog on a timeout into
the run's flight_recorder folder, which the error line names) and our op ledgers (`actions_rank<r>.json`): it
prints, per process group, the ranks that posted a collective the others never reached, and every NCCL op that did
not complete, each with the pipeline action it carried (traces/formats/flight_recorder.py). The dumps are read as data
only; a file that is not one is refused in one line (exit 2).

`--cuda DIR` replays the CUDA programs a run made with `--emulate-cuda --trace-dir DIR` wrote (every stream, event,
NCCL launch and host wait of every rank, docs/cuda_program.md) under CUDA's and NCCL's rules: `ok`, or the wait
cycle across ranks and streams (exit 1), then whether the run also finishes when NCCL kernels of one GPU progress
only in launch order (it says so when it needs kernels of different communicators to run concurrently).
`--blocking-wait` replays as under TORCH_NCCL_BLOCKING_WAIT=1.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from traces.analysis.comm_replay import VIEWS, ReplayResult, replay
from traces.nccl_rules import VIEW_OF_RULES
from traces.analysis.cuda_replay import Rules, replay_programs
from traces.formats.cuda_program import load_programs
from traces.formats.flight_recorder import analyse, is_dump_folder
from traces.formats.io import load_trace

MAX_LINES = 20
HELP = "replay a measured trace's communication under NCCL's rules: deadlocks, order mismatches, unmatched ops"
EXAMPLE = "mhcpipe check-comm runs/x/trace.json --comm-rules both --json runs/x/comm.json"


def register(subparsers) -> None:
    p = subparsers.add_parser("check-comm", help=HELP, description=f"{HELP}\n\nexample: {EXAMPLE}",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", metavar="TRACE", help="trace file of ours, the run's trace folder, or a folder of "
                   "Flight Recorder dumps")
    p.add_argument("--comm-rules", choices=(*VIEW_OF_RULES, "both"), default="both",
                   help="nccl: a queue per (rank, group); nccl-pair: per (rank, group, peer) for P2P; both (default)")
    p.add_argument("--json", dest="json_out", metavar="OUT", help="write the results as JSON here")
    p.add_argument("--cuda", action="store_true",
                   help="TRACE is a folder of CUDA programs (--emulate-cuda): replay streams, events and NCCL "
                        "launches under CUDA's and NCCL's rules")
    p.add_argument("--blocking-wait", action="store_true",
                   help="with --cuda: every stream-ordered wait blocks the host (TORCH_NCCL_BLOCKING_WAIT=1)")
    p.set_defaults(func=run_check_comm)


def format_result(res: ReplayResult, max_lines: int = MAX_LINES) -> list[str]:
    """The summary line, then at most `max_lines` problem lines and `... and K more`."""
    probs = res.problems
    lines = [res.summary(), *(f"  {p}" for p in probs[:max_lines])]
    if len(probs) > max_lines:
        lines.append(f"  ... and {len(probs) - max_lines} more")
    return lines


def run_check_comm(args: argparse.Namespace) -> int:
    path = Path(args.trace)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder (pass a trace written by --trace-dir)")
    if args.cuda:
        return _check_cuda(path, args.blocking_wait, args.json_out)
    if args.blocking_wait:
        raise ValueError("--blocking-wait replays CUDA programs: add --cuda")
    if is_dump_folder(path):
        return _check_flight_recorder(path, args.json_out)
    trace = load_trace(path)
    views = VIEWS if args.comm_rules == "both" else (VIEW_OF_RULES[args.comm_rules],)
    results = [replay(trace, v, source=str(path)) for v in views]
    for res in results:
        sys.stdout.write("\n".join(format_result(res)) + "\n")
    if args.json_out:
        out = Path(args.json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps([r.to_dict() for r in results], indent=1))
    return 0 if all(r.ok for r in results) else 1


def _check_flight_recorder(folder: Path, json_out: str | None) -> int:
    rep = analyse(folder)
    lines = [rep.summary(), *(f"  {p}" for p in rep.problems[:MAX_LINES])]
    if len(rep.problems) > MAX_LINES:
        lines.append(f"  ... and {len(rep.problems) - MAX_LINES} more")
    sys.stdout.write("\n".join(lines) + "\n")
    if json_out:
        out = Path(json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rep.to_dict(), indent=1))
    return 0 if rep.ok else 1


def _check_cuda(folder: Path, blocking_wait: bool, json_out: str | None) -> int:
    programs = load_programs(folder)
    res = replay_programs(programs, Rules(blocking_wait=blocking_wait))
    lines = res.lines()
    strict = None
    if res.ok:
        strict = replay_programs(programs, Rules(blocking_wait=blocking_wait, launch_order=True))
        lines.append("  NCCL launches in launch order only (NCCL_LAUNCH_ORDER_IMPLICIT's reading): " + (
            "ok too" if strict.ok else "would hang: this run needs NCCL kernels of different communicators to "
            "run concurrently (its cycle: the --json output, key launch_order)"))
    lines = lines[:MAX_LINES + 3] + ([f"  ... and {len(lines) - MAX_LINES - 3} more"]
                                     if len(lines) > MAX_LINES + 3 else [])
    sys.stdout.write("\n".join(lines) + "\n")
    if json_out:
        out = Path(json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"default": res.to_dict(),
                                   "launch_order": strict.to_dict() if strict is not None else None}, indent=1))
    return 0 if res.ok else 1
