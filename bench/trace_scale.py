"""How the trace tools scale: drawing and replaying traces of about 10^5 spans (the speed targets the unit tests
check only for correctness, at a smaller size).

    .venv/bin/python bench/trace_scale.py [--ranks 8] [--microbatches 2300] [--pairs 25000] [--reps 3]
                                          [--out bench/results/trace_scale.json]

Rows, each the median of --reps runs on one thread:
* `view png` / `view html`: traces.drawing.view.write_picture and traces.drawing.html_view.write_html of a simulated
1F1B
  schedule (schedules.simulate) of --ranks x --microbatches, compute and P2P spans (8 x 2300: ~10^5 spans).
  Target: under 20 s each (a user opens a long measured run with `mhcpipe view`).
* `check-comm`: traces.analysis.comm_replay.check_comm (both views) of a two-rank exchange with --pairs micro-batches,
  four P2P ops and two host waits each (25,000: 10^5 ops). Target: under 20 s (a worklist, not rescans).
A row over its target makes the exit code 1.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from schedules import build, simulate
from traces.analysis.comm_replay import check_comm
from traces.drawing.html_view import write_html
from traces.trace import Span, Trace
from traces.drawing.view import write_picture

TARGET_S = 20.0


def exchange(pairs: int) -> Trace:
    """Rank 0 sends F and receives B of every micro-batch, rank 1 the mirror, on one pipeline group in the same
    order on both ranks (so it runs), each receive followed by its host wait: 6 spans per micro-batch."""
    spans = []
    for m in range(pairs):
        for rank, peer, first, second in ((0, 1, "SEND_F", "RECV_B"), (1, 0, "RECV_F", "SEND_B")):
            for k, kind in enumerate((first, second)):
                stage = 0 if kind.endswith("F") else 1
                spans.append(Span(rank, "comm", kind, None, None, 2.0 * m + k, 1.0, peer=peer,
                                  name=f"{kind}/s{stage}/mb{m}~comm", group="pp:0,1", batch=2 * m + k))
        spans.append(Span(1, "compute", "WAIT", None, None, 2.0 * m + 0.1, 0.5, name=f"WAIT/RECV_F/s0/mb{m}"))
        spans.append(Span(0, "compute", "WAIT", None, None, 2.0 * m + 1.1, 0.5, name=f"WAIT/RECV_B/s1/mb{m}"))
    return Trace(spans)


def timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=2300)
    ap.add_argument("--pairs", type=int, default=25_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "trace_scale.json")
    args = ap.parse_args(argv)
    for name in ("ranks", "microbatches", "pairs", "reps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} {getattr(args, name)}: must be >= 1")
    import torch

    torch.set_num_threads(1)
    big = simulate(build("1f1b", args.ranks, args.microbatches)).trace
    comm = exchange(args.pairs)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for what, size, fn in (
                ("view png", len(big.spans), lambda: write_picture(Path(tmp) / "big.png", [big])),
                ("view html", len(big.spans), lambda: write_html(Path(tmp) / "big.html", [big])),
                ("check-comm", len(comm.spans), lambda: check_comm(comm))):
            s = timed(fn, args.reps)
            rows.append({"what": what, "spans": size, "seconds": s, "target_s": TARGET_S})
            print(f"{what:<11} {size:>8,} spans  {s:7.2f} s  (target < {TARGET_S:g} s)", flush=True)
    ok = all(r.ok and r.ops == 4 * args.pairs for r in check_comm(comm))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "what": "median seconds of --reps runs, one thread", "args": {k: v for k, v in vars(args).items()
                                                                    if k != "out"},
        "rows": rows, "replay_ok": ok,
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "cpus": os.cpu_count()}},
        indent=1))
    print(f"wrote {args.out}")
    return 0 if ok and all(r["seconds"] < TARGET_S for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
