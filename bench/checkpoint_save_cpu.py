"""Benchmark: how long a checkpoint save holds the training loop, synchronous against asynchronous
(pipeline/checkpoint/async_save.py), on the demo config (configs/tiny.yaml: DualPipeV, 4 ranks) and on 2 ranks (a
core each here), a checkpoint after every step.

Each variant is one `mhcpipe run` (fresh processes, fresh folder): none (no checkpoint), sync, async. Reported: the
loop's blocked time per save (the run's own `checkpoints:` line: staging + waiting for the previous save, rank 0)
as a share of the median step, and the median step time (a background writer shares the cores).

    .venv/bin/python bench/checkpoint_save_cpu.py [--steps 12] [--out bench/results/checkpoint_save_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(args: list[str], folder: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "mhcpipe", "run", *args], cwd=folder, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise SystemExit(f"mhcpipe run {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    steps = [float(m.group(1)) for m in re.finditer(r"^step \d+/\d+ .*step_time (\S+) ms", proc.stdout, re.M)]
    m = re.search(r"checkpoints: (\d+) saved \((\w+)\), the loop blocked (\S+) ms per save", proc.stdout)
    return {"median_step_ms": statistics.median(steps[2:]), "saves": int(m.group(1)) if m else 0,
            "blocked_ms_per_save": float(m.group(3)) if m else 0.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "checkpoint_save_cpu.json")
    args = ap.parse_args()
    out = {"cores": os.cpu_count(), "steps": args.steps, "layouts": {},
           "command": "bench/checkpoint_save_cpu.py " + " ".join(sys.argv[1:])}
    print(f"{'layout':<22}{'variant':<8}{'median step ms':>16}{'blocked ms/save':>17}{'% of a step':>13}")
    for name, layout in (("dualpipev pp4 (demo)", []), ("dualpipev pp2", ["--pp", "2"])):
        rows = {}
        with tempfile.TemporaryDirectory() as tmp:
            base = ["--config", "tiny", "--steps", str(args.steps), *layout]
            rows["none"] = one(base, Path(tmp))
            rows["sync"] = one([*base, "--checkpoint-dir", "sync"], Path(tmp))
            rows["async"] = one([*base, "--checkpoint-dir", "async", "--async-checkpoint"], Path(tmp))
        for variant, r in rows.items():
            r["blocked_share_of_step"] = r["blocked_ms_per_save"] / r["median_step_ms"]
            print(f"{name:<22}{variant:<8}{r['median_step_ms']:>16.1f}{r['blocked_ms_per_save']:>17.1f}"
                  f"{100 * r['blocked_share_of_step']:>12.1f}%")
        out["layouts"][name] = rows
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
