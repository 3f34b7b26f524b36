"""Benchmark: does DualPipe's F&B pair hide its communication? Overlapped vs serial pairs on 4 gloo ranks.

    .venv/bin/python bench/overlap_cpu.py [--config tiny-moe] [--pp 2 --dp 2 --ep 2] [--microbatches 16]
                                          [--steps 10] [--warmup 2] [--cpu-bind] [--out bench/results/overlap_cpu.json]

One job trains the same model twice, F&B pairs overlapped (the default) and serial (`--no-overlap`: forward,
then backward, every all-to-all waited right after its post, the pair's sends after it), one step of each in turn
(`pipeline.runtime.train.train_interleaved`), so both see the same machine state; both traces are recorded. From the
traces (`traces.analysis.comm_overlap`, steps after the warm-up): the share of communication time the compute thread did
not block on, for the ops posted inside F&B pairs (the expert-parallel all-to-alls and the pair's sends), split
by kind, and over the whole step; the time blocked per step; and the step time (slowest rank, median) with the
overlapped / serial ratio. For the all-to-alls it also reports how much of the blocked time came before the
EP peer had posted the same exchange (waiting for a late peer rather than for the transfer).

`--cpu-bind` binds local rank i to core i mod cores (`train.cpu_bind`): on a host with fewer cores than ranks
that keeps the two EP peers on different cores, so they run, and exchange, at the same time.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs import load_config
from pipeline.launch.local import interleaved_worker, launch
from traces.analysis.comm_overlap import comm_overlap, total
from traces.trace import Trace


def after_warmup(trace: Trace, warmup: int) -> Trace:
    """The trace without each rank's spans that start before its step `warmup` began."""
    begin = {s.rank: s.start for s in trace.spans if s.kind == "step" and s.label == f"step/{warmup}"}
    return Trace([s for s in trace.spans if s.start >= begin.get(s.rank, float("inf"))], dict(trace.meta))


def late_peer_wait_us(trace: Trace, layout: dict) -> tuple[float, float]:
    """(blocked time on all-to-alls inside F&B pairs, the part of it before the EP peer posted the exchange)."""
    dp, ep = layout["dp"], layout["ep"]
    group = {r: (r // dp, (r % dp) // ep) for r in trace.ranks}  # (pp rank, EP block) of a global rank
    posts: dict[tuple, list[float]] = defaultdict(list)  # (group, name) -> post times of every instance, all ranks
    mine: dict[tuple, list[float]] = defaultdict(list)
    fbs = defaultdict(list)
    for s in trace.spans:
        if s.stream == "comm" and s.kind.startswith("A2A"):
            name = s.label[:-5]
            posts[(group[s.rank], name)].append(s.start)
            mine[(s.rank, name)].append(s.start)
        elif s.kind == "FB":
            fbs[s.rank].append((s.start, s.end))
    blocked = late = 0.0
    for w in trace.spans:
        if w.kind != "WAIT" or not w.label.startswith("WAIT/A2A") or \
                not any(a <= w.start <= b for a, b in fbs[w.rank]):
            continue
        name = w.label[5:]
        k = sum(1 for t in mine[(w.rank, name)] if t <= w.start)  # which instance (step) of the exchange
        every = sorted(posts[(group[w.rank], name)])
        if k == 0 or len(every) < k * ep:
            continue
        ready = max(every[(k - 1) * ep:k * ep])  # the last of the group's posts of that instance
        blocked += w.duration
        late += max(0.0, min(w.end, ready) - w.start)
    return blocked, late


def summarize(trace: Trace, layout: dict, steps: int) -> dict:
    o = comm_overlap(trace)
    fb = total(o, fb=True)
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for x in o.values():
        for kind, share in x.by_kind.items():
            by_kind[kind][0] += share.comm_us
            by_kind[kind][1] += share.exposed_us
    fb_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    # per kind inside F&B: recompute from the spans (CommShare keeps only totals for the pair subset)
    for kind in ("A2A", "SEND"):
        sub = Trace([s for s in trace.spans if not (s.stream == "comm" and not s.kind.startswith(kind))],
                    dict(trace.meta))
        part = total(comm_overlap(sub), fb=True)
        fb_kind[kind] = [part.comm_us, part.exposed_us]
    blocked, late = late_peer_wait_us(trace, layout)
    everything = total(o)
    return {
        "fb_comm_hidden_pct": fb.hidden_pct, "fb_comm_us_per_step": fb.comm_us / steps,
        "fb_blocked_us_per_step": fb.exposed_us / steps,
        "fb_by_kind_hidden_pct": {k: (100.0 * (1 - e / c) if c else None) for k, (c, e) in fb_kind.items()},
        "comm_hidden_pct": everything.hidden_pct, "blocked_us_per_step": everything.exposed_us / steps,
        "by_kind_hidden_pct": {k: (100.0 * (1 - e / c) if c else None) for k, (c, e) in sorted(by_kind.items())},
        "fb_a2a_blocked_us_per_step": blocked / steps,
        "fb_a2a_blocked_before_peer_posted_us_per_step": late / steps,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny-moe")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=16, help="of the global batch (default 16: 8 per replica)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--cpu-bind", action="store_true")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "overlap_cpu.json")
    args = ap.parse_args(argv)
    if args.steps <= args.warmup:
        ap.error("--steps must exceed --warmup")
    over = {"parallel": {"ranks": args.pp, "data_parallel": args.dp, "expert_parallel": args.ep,
                         "microbatches": args.microbatches},
            "train": {"steps": args.steps, "cpu_bind": args.cpu_bind}}
    cfgs = []
    for overlap in (True, False):
        over["parallel"]["overlap"] = overlap
        cfgs.append(load_config(args.config, json.loads(json.dumps(over))).model_dump())
    world = args.pp * args.dp
    layout = {"pp": args.pp, "dp": args.dp, "ep": args.ep}
    with tempfile.TemporaryDirectory(prefix="overlap_") as tmp:
        dirs = [str(Path(tmp) / "overlap"), str(Path(tmp) / "serial")]
        res = launch(interleaved_worker, world, (cfgs, dirs), timeout_s=1800)
        bad = [(r.rank, r.exitcode, r.error) for r in res if r.exitcode != 0 or r.error]
        if bad:
            print(f"launch failed: {bad}", file=sys.stderr)
            return 1
        timed = args.steps - args.warmup
        rows = {}
        for name, d, hist in zip(("overlap", "serial"), dirs, res[0].value):
            trace = after_warmup(Trace.load(Path(d) / "trace.json"), args.warmup)
            step_s = [s["step_time_s"] for s in hist[args.warmup:]]
            rows[name] = {"step_s_median": statistics.median(step_s), "step_s": step_s,
                          "losses": [s["loss"] for s in hist], **summarize(trace, layout, timed)}
    ratio = rows["overlap"]["step_s_median"] / rows["serial"]["step_s_median"]
    print(f"{args.config}: pp={args.pp} dp={args.dp} ep={args.ep}, M={args.microbatches}, {world} gloo ranks on "
          f"{os.cpu_count()} cores{', --cpu-bind' if args.cpu_bind else ''}; {timed} timed steps each")
    print(f"{'variant':<8} {'step ms':>8} {'F&B hidden %':>13} {'a2a %':>6} {'send %':>7} {'all hidden %':>13} "
          f"{'blocked ms/step':>16} {'a2a late-peer ms':>17}")
    for name, r in rows.items():
        k = r["fb_by_kind_hidden_pct"]
        fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        print(f"{name:<8} {r['step_s_median'] * 1e3:>8.1f} {fmt(r['fb_comm_hidden_pct']):>13} {fmt(k['A2A']):>6} "
              f"{fmt(k['SEND']):>7} {fmt(r['comm_hidden_pct']):>13} {r['blocked_us_per_step'] / 1e3:>16.1f} "
              f"{r['fb_a2a_blocked_before_peer_posted_us_per_step'] / 1e3:>8.1f} of "
              f"{r['fb_a2a_blocked_us_per_step'] / 1e3:.1f}")
    print(f"step time overlapped / serial: {ratio:.3f}")
    same = rows["overlap"]["losses"] == rows["serial"]["losses"]
    print(f"same losses: {same}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    import torch

    args.out.write_text(json.dumps({
        "config": args.config, "layout": layout, "microbatches": args.microbatches, "steps": args.steps,
        "warmup": args.warmup, "cpu_bind": args.cpu_bind, "ratio_overlap_over_serial": ratio, "results": rows,
        "definitions": "hidden = communication time (post to completion) not covered by WAIT spans of the compute "
                       "thread; F&B = ops posted inside an F&B pair's span; steps after the warm-up",
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "cpus": os.cpu_count()}},
        indent=1))
    print(f"wrote {args.out}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
