"""The trace tools across hundreds of ranks (issue 58 item 3): one step of a 256-rank run (P = 16 pipeline ranks x
D = 16 data-parallel replicas), generated from the schedule simulator with the ops a real step records, then
`mhcpipe critical-path`, `mhcpipe overlap` and `mhcpipe view -o PNG` (the slowest replica's pipeline in full, the
other replicas summarised: traces/drawing/replica_summary.py) on it as a user runs them: wall time and peak RSS
(GNU time).

    .venv/bin/python bench/trace_scale_ranks.py [--pp 16] [--dp 16] [--microbatches 64] [--layers 4]
                                                [--json bench/results/trace_scale_ranks.json]

The step (`synthetic_step`): DualPipeV on P ranks with M micro-batches per replica, simulated by
schedules.simulate with DeepSeek-V3's action ratios (F 1, I 1.2, W 0.4 of F; one stage-boundary message 2.5% of
F). Inside each compute action, per layer, what the runtime records there (traces.md §5): the mHC post/res kernel
on the high-priority stream, and the MoE layer's two all-to-alls (dispatch and combine, or their gradients) on
the EP group, posted inside the op; each rank ends its step with its gradient all-reduce (RG) and the optimizer
step. Replica d runs 0.5% x d slower (the last one is the straggler the analyses pick). 16 x 16 x 64 micro-batches
x 4 layers: ~5 x 10^5 spans. Our own trace format (meta layout pp, dp); its P2P spans as the simulator writes them
(from the transfer to its arrival).

The critical path runs on one replica's pipeline (traces/analysis/replicas.py: the slowest), across its P ranks;
tests/bench/test_trace_scale_ranks.py checks that path against a brute-force longest path on a small case.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from schedules import Durations, build, simulate  # noqa: E402
from traces.trace import Span, Trace  # noqa: E402

F_US = 10_000.0  # one forward chunk (V3-like scale: ~10 ms); only the ratios matter
RATIOS = {"F": 1.0, "I": 1.2, "W": 0.4}
MESSAGE_SHARE = 0.025  # a stage-boundary transfer, of F
PART_SHARE = 0.04  # the post/res kernel of one layer, of its layer's time
A2A_SHARE = 0.15  # each all-to-all of one layer, of its layer's time
SLOWER_PER_REPLICA = 0.005


def _parts(s: Span, layers: int, stage_layers: range, batches: dict) -> list[Span]:
    """What the runtime records inside compute span `s`: per layer, the post/res kernel (hp stream) and the two
    all-to-alls of its MoE layer (comm stream, on the EP group of the rank's pipeline position)."""
    out: list[Span] = []
    halves = [(s.kind if s.kind != "FB" else "F", s.stage, s.mb, s.start, s.duration)]
    if s.kind == "FB":  # the pair: its forward half first, then its backward half (the pair's two shares)
        f = s.duration * RATIOS["F"] / (RATIOS["F"] + RATIOS["I"] + RATIOS["W"])
        halves = [("F", s.stage, s.mb, s.start, f), ("B", *s.partner, s.start + f, s.duration - f)]
    for kind, stage, mb, t0, dur in halves:
        step = dur / layers
        for k, layer in enumerate(stage_layers):
            at = t0 + k * step
            tag = "" if kind == "F" else ".dgrad"
            group = f"ep-{'F' if kind == 'F' else 'B'}"
            for op, off in (("A2A_DISPATCH", 0.2), ("A2A_COMBINE", 0.6)):
                n = batches.get(group, 0)
                batches[group] = n + 1
                out.append(Span(s.rank, "comm", op + tag, stage, mb, at + off * step, A2A_SHARE * step, None, None,
                                f"{op}/s{stage}/mb{mb}/L{layer}{tag}~comm", group, n))
            if kind == "F":  # post/res runs on the hp stream in the forward (pipeline.runtime.stage)
                out.append(Span(s.rank, "hp", "F.post_res", stage, mb, at + 0.9 * step, PART_SHARE * step, None,
                                None, f"F/s{stage}/mb{mb}/L{layer}.post_res~hp"))
    return out


def synthetic_step(pp: int = 16, dp: int = 16, microbatches: int = 64, layers: int = 4,
                   schedule: str = "dualpipev") -> Trace:
    """One step of a pp x dp run as our runtime's trace (global rank = pipeline rank x dp + replica)."""
    sched = build(schedule, pp, microbatches)
    durations = Durations(**{k: v * F_US for k, v in RATIOS.items()}, p2p_latency=MESSAGE_SHARE * F_US)
    pipe = simulate(sched, durations)
    stage_layers = {st: range(st * layers, (st + 1) * layers) for st in range(sched.num_stages)}
    spans: list[Span] = []
    for d in range(dp):
        slow = 1.0 + SLOWER_PER_REPLICA * d
        batches: dict[int, dict] = {}
        ends: dict[int, float] = {}
        for s in pipe.trace.spans:
            g = s.rank * dp + d
            t = Span(g, s.stream, s.kind, s.stage, s.mb, s.start * slow, s.duration * slow, s.partner,
                     None if s.peer is None else s.peer * dp + d, s.name)
            spans.append(t)
            if t.stream == "compute":
                spans.extend(_parts(t, layers, stage_layers[t.stage], batches.setdefault(g, {})))
                ends[g] = max(ends.get(g, 0.0), t.end)
        for g, end in ends.items():  # the rank's gradient all-reduce over its replicas, then the optimizer
            rg = Span(g, "comm", "RG", None, None, end, 0.3 * F_US, None, None, f"RG/r{g // dp}/dense~comm",
                      f"grad:{g // dp}", 0)
            spans += [rg, Span(g, "compute", "OPT", None, None, rg.end, 0.1 * F_US, None, None, "OPT")]
    spans.sort(key=lambda s: (s.rank, s.start))
    meta = {**pipe.trace.meta, "layout": {"pp": pp, "dp": dp},
            "synthetic": f"bench/trace_scale_ranks.py: {schedule} P={pp} x D={dp}, M={microbatches}, {layers} layers"}
    return Trace(spans=spans, meta=meta)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=16)
    ap.add_argument("--dp", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "trace_scale_ranks.json")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from trace_scale_runs import timed  # the same GNU time measurement as the 10^6-span rows

    trace = synthetic_step(args.pp, args.dp, args.microbatches, args.layers)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        trace.save(path)
        size_mb = path.stat().st_size / 1e6
        out = Path(tmp) / "cp.json"
        rows["critical-path"] = timed(["critical-path", str(path), "--json", str(out)])
        rows["overlap"] = timed(["overlap", str(path)])
        rows["view"] = timed(["view", str(path), "-o", str(Path(tmp) / "view.png")])  # replicas summarised
        path_json = json.loads(out.read_text()) if out.exists() else {}
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
              "ranks": args.pp * args.dp, "pp": args.pp, "dp": args.dp, "microbatches": args.microbatches,
              "layers": args.layers, "spans": len(trace.spans), "file_mb": round(size_mb, 1), "rows": rows,
              "path": {k: path_json.get(k) for k in ("makespan_us", "length_us", "exposed_comm_us", "scope")},
              "path_ops": len(path_json.get("path", []))}
    print(f"{result['ranks']} ranks ({args.pp} x {args.dp}), {len(trace.spans):,} spans, {size_mb:.0f} MB")
    print(f"{'command':<16}{'wall s':>10}{'peak RSS GB':>14}")
    for name, r in rows.items():
        print(f"{name:<16}{r['wall_s']:>10.1f}{r['peak_rss_gb']:>14.2f}" + (f"  {r['error']}" if r["rc"] else ""))
    print(f"critical path: {result['path_ops']} ops, {result['path']['scope']}")
    args.json.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")
    return 1 if any(r["rc"] for r in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
