"""The trace tools on traces the size of real runs (issue 58): a measured run of this runtime tiled to --spans spans
(whole steps repeated, each copy shifted past the last), then each command as a user runs it, its wall time and
peak memory (RSS) measured by /usr/bin/time.

    .venv/bin/python bench/trace_scale_runs.py [--spans 1000000] [--source TRACE.json] [--rev 972bc6e]
                                               [--commands critical-path,overlap] [--npz] [--repeat 3]
                                               [--json RESULT.json]

The measured run: `mhcpipe run --config configs/tiny.yaml --schedule dualpipev --steps 6 --trace-dir ...` on 4 gloo
ranks (or --source, a trace of ours). The commands: critical-path, overlap, whatif (--scale F=0.5), compare (the
tiled trace against itself: the reader twice), view -o PNG, and critical-path on the same trace written in our
JSON's version 1 (an object per span; docs/traces.md §7); --commands picks some. --npz: the same commands on the
trace written as our binary columns (.npz, docs/traces.md §8), and critical-path / whatif of steps 100..109 of it
(`--steps`: spans made for those steps only). Targets (issue 58): <= 5 s and
<= 1 GB at 10^6 spans, <= 60 s and <= 4 GB at 10^7; a row over either is marked, and the exit code is 1 if any row
is. --rev: the same commands at another git revision too (a scratch worktree), in the same run, on the same file,
or on the version-1 file for a revision before version 2, the .npz rows too where that revision reads .npz; the two
revisions take turns command by command (this VM's speed drifts by tens of percent within minutes).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from traces.formats.io import load_trace  # noqa: E402
from traces.formats.npz import save_npz  # noqa: E402
from traces.trace import Trace  # noqa: E402

PY = str(ROOT / ".venv" / "bin" / "python")
COMMANDS = ("critical-path", "overlap", "whatif", "compare", "view")
TARGETS = {1_000_000: (5.0, 1.0), 10_000_000: (60.0, 4.0)}  # issue 58: spans -> (wall s, peak GB)
CAP_S = 300  # a command still running after this is stopped and reported as over it


def measured_run(workdir: Path) -> Path:
    out = workdir / "run"
    subprocess.run([PY, "-m", "mhcpipe", "run", "--config", "configs/tiny.yaml", "--schedule", "dualpipev",
                    "--steps", "6", "--trace-dir", str(out)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return out / "trace.json"


def tiled(trace: Trace, spans: int) -> Trace:
    """The trace's spans repeated, each copy shifted by the trace's length (plus a 1% gap), until >= `spans`."""
    first = min(s.start for s in trace.spans)
    length = max(s.end for s in trace.spans) - first
    shift = length * 1.01
    copies = -(-spans // len(trace.spans))
    out = []
    for k in range(copies):
        out.extend(replace(s, start=s.start + k * shift) for s in trace.spans)
    meta = dict(trace.meta)
    if "steps" in meta:
        meta["steps"] = int(meta["steps"]) * copies
    return Trace(spans=out, meta=meta)


# Reading a process's smaps_rollup walks its page tables under its memory-map lock: sampled every 50 ms, the
# readings slowed a whatif whose forked workers fault in copied pages by 0.3-0.7 s of ~5 s (measured: plain run
# 5.31 / 4.78 s, timed() 5.59 / 5.46 s). A command's memory grows with what it reads and stays: a reading every
# 250 ms still sees its peak.
SAMPLE_S = 0.25


def timed(argv: list[str], tree: Path = ROOT) -> dict:
    """Wall seconds and peak memory (GB) of one command run from `tree`; its exit code. Memory: the larger of GNU
    time's peak RSS (of the largest process) and the peak, sampled every SAMPLE_S, of the proportional set sizes
    summed over the command's process tree (whatif and compare fork workers that share the parent's pages:
    their RSS would count the shared pages twice, GNU time's only the largest process)."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as f:
        proc = subprocess.Popen(["/usr/bin/time", "-f", "%e %M", "-o", f.name, PY, "-m", "mhcpipe", *argv],
                                cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(tree)}, start_new_session=True)
        err_chunks: list[str] = []
        reader = threading.Thread(target=lambda: err_chunks.append(proc.stderr.read()), daemon=True)
        reader.start()
        tree_peak, t0 = 0, time.monotonic()
        while proc.poll() is None:
            if time.monotonic() - t0 > CAP_S:
                os.killpg(proc.pid, signal.SIGKILL)  # time and the command under it
                proc.wait()
                return {"wall_s": float(CAP_S), "peak_rss_gb": float("nan"), "rc": -1,
                        "error": f"stopped after {CAP_S} s"}
            tree_peak = max(tree_peak, sum(_pss(p) for p in _process_tree(proc.pid)))
            time.sleep(SAMPLE_S)
        reader.join()
        err = "".join(err_chunks)
        wall, kb = f.read().split()[-2:]
    return {"wall_s": float(wall), "peak_rss_gb": max(int(kb) * 1e3, tree_peak) / 1e9,
            "peak_rss_largest_process_gb": int(kb) / 1e6, "peak_pss_tree_gb": tree_peak / 1e9,
            "rc": proc.returncode, "error": err.strip().splitlines()[-1] if proc.returncode and err.strip() else ""}


def _median_run(runs: list[dict]) -> dict:
    """Several runs of one command: the median wall time, the largest memory, every wall time listed."""
    out = dict(sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2])
    out["peak_rss_gb"] = max(r["peak_rss_gb"] for r in runs)
    if len(runs) > 1:
        out["walls_s"] = [r["wall_s"] for r in runs]
    return out


def _process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (Linux /proc)."""
    out = [pid]
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                for child in fh.read().split():
                    out += _process_tree(int(child))
    except OSError:  # exited meanwhile
        pass
    return out


def _pss(pid: int) -> int:
    """A process's proportional set size in bytes (its private pages, and its share of pages it shares)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spans", type=int, default=1_000_000)
    ap.add_argument("--source", type=Path, help="a trace of ours to tile (default: measure a tiny run first)")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "trace_scale_runs.json")
    ap.add_argument("--rev", help="also run the commands at this git revision (a scratch worktree)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each command (the revisions taking turns): the "
                    "median wall time, the largest memory")
    ap.add_argument("--npz", action="store_true", help="also the commands on the trace as .npz, and --steps on it")
    ap.add_argument("--commands", help="run only these, comma-separated (critical-path, overlap, whatif, compare, "
                                       "view, v1: critical-path on the version-1 file); default all")
    args = ap.parse_args()
    if not shutil.which("/usr/bin/time"):
        print("bench/trace_scale_runs.py: needs GNU time at /usr/bin/time", file=sys.stderr)
        return 2
    unknown = sorted(set((args.commands or "").split(",")) - set(COMMANDS) - {"v1", ""})
    if unknown:
        print(f"--commands {','.join(unknown)}: choose from {', '.join(COMMANDS)}, v1", file=sys.stderr)
        return 2
    target_s, target_gb = TARGETS[min((n for n in TARGETS if n >= args.spans), default=max(TARGETS))]
    work = Path(tempfile.mkdtemp(prefix="trace_scale_"))
    try:
        source = args.source or measured_run(work)
        base = load_trace(source)
        big = tiled(base, args.spans)
        path = work / "big.json"
        big.save(path)
        path_v1 = work / "big_v1.json"
        png = work / "big.png"
        commands = {
            "critical-path": ["critical-path", str(path)],
            "overlap": ["overlap", str(path)],
            "whatif": ["whatif", str(path), "--scale", "F=0.5"],
            "compare": ["compare", str(path), str(path)],
            "view": ["view", str(path), "-o", str(png)],
        }
        if args.commands:
            commands = {k: v for k, v in commands.items() if k in args.commands.split(",")}
        at_rev = dict(commands)
        if args.npz:
            npz = save_npz(big, work / "big.npz")
            commands.update({f"{k} npz": [str(npz) if a == str(path) else a for a in v]
                             for k, v in list(commands.items())})
            commands["critical-path npz --steps 100..109"] = ["critical-path", str(npz), "--steps", "100..109"]
            commands["whatif npz --steps 100..109"] = ["whatif", str(npz), "--scale", "F=0.5", "--steps", "100..109"]
        size = len(big.spans)
        del big  # the commands run in their own processes: this one need not hold 10^7 spans meanwhile
        old: dict[str, list[str]] = {}
        tree = work / "rev"
        if args.rev:
            # a revision that reads version 2 gets the same file; an older one the version-1 file; the .npz rows
            # where the revision reads .npz (and --steps)
            def at(path_in_tree: str) -> str:
                return subprocess.run(["git", "show", f"{args.rev}:{path_in_tree}"], cwd=ROOT, capture_output=True,
                                      text=True).stdout
            # (FORMAT_VERSION moved from traces/trace.py to traces/trace_json.py at a5f8ae1)
            reads_v2 = any("FORMAT_VERSION = 2" in at(f) for f in ("traces/trace.py", "traces/trace_json.py"))
            old = {name: [str(path_v1) if a == str(path) and not reads_v2 else a for a in argv]
                   for name, argv in at_rev.items()}
            if at("traces/formats/npz.py"):
                steps = '"--steps"' in at("mhcpipe/analysis_cli.py")
                old.update({name: argv for name, argv in commands.items()
                            if name.endswith(" npz") or (steps and "--steps" in name)})
            subprocess.run(["git", "worktree", "add", "--detach", str(tree), args.rev], cwd=ROOT, check=True,
                           capture_output=True)
        want_v1 = not args.commands or "v1" in args.commands.split(",")
        if want_v1 or (args.rev and not reads_v2):
            path_v1.write_text(json.dumps(Trace.load(path).to_records()))
        try:
            # the revisions take turns command by command: this VM's speed drifts by tens of percent in minutes
            rows, before = {}, ({} if args.rev else None)
            for name, argv in commands.items():
                runs, runs_then = [], []
                for _ in range(args.repeat):
                    runs.append(timed(argv))
                    if name in old:
                        runs_then.append(timed(old[name], tree))
                rows[name] = _median_run(runs)
                if runs_then:
                    before[name] = _median_run(runs_then)
        finally:
            if args.rev:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
        if want_v1:
            rows["critical-path v1 file"] = timed(["critical-path", str(path_v1)])
        result = {"spans": size, "source_spans": len(base.spans), "file_mb": path.stat().st_size / 1e6,
                  "file_npz_mb": (work / "big.npz").stat().st_size / 1e6 if args.npz else None,
                  "file_v1_mb": path_v1.stat().st_size / 1e6 if path_v1.exists() else None,
                  "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "targets": {"wall_s": target_s,
                                                                                        "peak_rss_gb": target_gb},
                  "rows": rows, "rev": args.rev, "rows_at_rev": before,
                  "rev_file": None if before is None else ("version 2" if reads_v2 else "version 1")}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    over = False
    v1 = f", {result['file_v1_mb']:.0f} MB as version 1" if result["file_v1_mb"] else ""
    print(f"{result['spans']:,} spans ({result['file_mb']:.0f} MB of JSON{v1}; "
          f"tiled from {result['source_spans']:,})")
    before = result["rows_at_rev"]
    if result["file_npz_mb"]:
        print(f"as .npz: {result['file_npz_mb']:.0f} MB")
    print(f"{'command':<36}{'wall s':>9}{'peak GB':>9}" + (f"{'at ' + args.rev:>22}" if before else "") + "  note")
    for name, r in rows.items():
        bad = r["wall_s"] > target_s or r["peak_rss_gb"] > target_gb
        over |= bad
        note = (f"exit {r['rc']}: {r['error'][:80]}" if r["rc"] else "") + (" over target" if bad else "")
        then = (f"{before[name]['wall_s']:>12.1f} s {before[name]['peak_rss_gb']:>5.2f} GB"
                if before and name in before else " " * 22 if before else "")
        print(f"{name:<36}{r['wall_s']:>9.1f}{r['peak_rss_gb']:>9.2f}{then}  {note}")
    args.json.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
