"""Reading a large PyTorch profiler (Kineto) file (issue 58, readers that stream): a third-party profiler trace's
events tiled --copies times (each copy shifted past the last, its correlation and External ids, flow ids and
ProfilerStep numbers offset so the copies stay apart), written as plain JSON, then `mhcpipe overlap --json` and
`mhcpipe view -o PNG` on it, wall time and peak RSS by GNU time; with --rev, the same at another revision in the
same run (the revisions taking turns), and whether their output files are the same bytes.

    .venv/bin/python bench/kineto_read.py [--source ../shared/data/traces/hta_rank0.json.gz] [--copies 10]
                                          [--rev 3ee9418] [--json bench/results/kineto_read.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.trace_scale_runs import timed  # noqa: E402
from traces.formats.kineto import read_json  # noqa: E402

DEFAULT_SOURCE = ROOT.parent / "shared" / "data" / "traces" / "hta_rank0.json.gz"
ID_STRIDE = 10 ** 7  # added to a copy's correlation / External / flow ids: above any id a profiler file holds


def tiled_events(doc: dict, copies: int) -> dict:
    events = doc["traceEvents"]
    stamps = [e["ts"] for e in events if isinstance(e, dict) and isinstance(e.get("ts"), (int, float))]
    shift = max(stamps) - min(stamps) + 1000
    out = []
    for k in range(copies):
        for e in events:
            e = dict(e)
            if isinstance(e.get("ts"), (int, float)):
                e["ts"] += k * shift
            if isinstance(e.get("args"), dict):
                e["args"] = {a: (v + k * ID_STRIDE if a in ("correlation", "External id") and isinstance(v, int)
                                 else v) for a, v in e["args"].items()}
            if isinstance(e.get("id"), int):
                e["id"] += k * ID_STRIDE
            name = e.get("name")
            if isinstance(name, str) and name.startswith("ProfilerStep#") and name[13:].isdigit():
                e["name"] = f"ProfilerStep#{int(name[13:]) + k * ID_STRIDE}"
            out.append(e)
    return {**doc, "traceEvents": out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="a PyTorch profiler trace to tile")
    ap.add_argument("--copies", type=int, default=10)
    ap.add_argument("--rev", help="also run at this git revision (a scratch worktree)")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "kineto_read.json")
    args = ap.parse_args()
    if not args.source.is_file():
        print(f"--source {args.source}: no such file (the shared trace folder holds hta_rank0.json.gz)",
              file=sys.stderr)
        return 2
    if not shutil.which("/usr/bin/time"):
        print("bench/kineto_read.py: needs GNU time at /usr/bin/time", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="kineto_read_"))
    trees = {"this tree": ROOT}
    try:
        doc = tiled_events(read_json(args.source), args.copies)
        events = len(doc["traceEvents"])
        path = work / "big.json"
        path.write_text(json.dumps(doc))
        del doc
        if args.rev:
            trees[args.rev] = work / "rev"
            subprocess.run(["git", "worktree", "add", "--detach", str(trees[args.rev]), args.rev], cwd=ROOT,
                           check=True, capture_output=True)
        rows: dict[str, dict] = {}
        outputs: dict[str, dict[str, bytes]] = {}
        for command, flag, suffix in (("overlap", "--json", ".json"), ("view", "-o", ".png")):
            for k, (name, tree) in enumerate(trees.items()):  # the revisions take turns, command by command
                out = work / f"{command}-{k}{suffix}"
                rows.setdefault(command, {})[name] = timed([command, str(path), flag, str(out)], tree)
                outputs.setdefault(command, {})[name] = out.read_bytes() if out.exists() else b""
        same = {c: len(set(o.values())) == 1 for c, o in outputs.items()}
        result = {"source": args.source.name, "copies": args.copies, "events": events,
                  "file_mb": path.stat().st_size / 1e6, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                  "rows": rows, "rev": args.rev, "same_json_output": same if args.rev else None}
    finally:
        if args.rev:
            subprocess.run(["git", "worktree", "remove", "--force", str(work / "rev")], cwd=ROOT, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.source.name} x {args.copies}: {events:,} events, {result['file_mb']:.0f} MB of JSON")
    print(f"{'command':<16}" + "".join(f"{name:>24}" for name in trees) + "  same output")
    for command, by_tree in rows.items():
        cells = "".join(f"{r['wall_s']:>12.1f} s {r['peak_rss_gb']:>6.2f} GB" for r in by_tree.values())
        print(f"{command:<16}{cells}  {same[command] if args.rev else '-'}")
    args.json.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")
    return 0 if all(r["rc"] == 0 for by in rows.values() for r in by.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
