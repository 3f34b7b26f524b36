"""How fast the cost model answers (issue 57 item 6): `mhcpipe predict` wall time (a fresh process, imports
included) and in-process time, and `mhcpipe tune` wall time, for paper-27b and DeepSeek-V3 on h800; with --rev,
the same at another git revision (checked out into a scratch worktree) in the same run, so before/after share the
machine and its load.

    .venv/bin/python bench/costmodel_speed.py [--rev 972bc6e] [--repeat 3] [--json bench/results/costmodel_speed.json]

Each time is the median of --repeat runs (tune: of --tune-repeat), one at a time, the revisions taking turns run
by run (this VM's speed drifts by tens of percent over minutes: turns keep that drift out of the comparison). The
in-process time is `predict(...)` plus its report (format_table) after the imports, timed inside one process.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = ROOT / ".venv" / "bin" / "python"
PREDICTS = {"paper-27b": ["--preset", "paper-27b", "--hardware", "h800"],
            "deepseek-v3": ["--preset", "deepseek-v3", "--hardware", "h800"]}
TUNES = {"paper-27b": ["--preset", "paper-27b", "--hardware", "h800", "--gpus", "48", "--memory-gib", "80",
                       "--global-batch", "1280"],
         "deepseek-v3": ["--preset", "deepseek-v3", "--hardware", "h800", "--gpus", "2048", "--memory-gib", "80",
                         "--global-batch", "15360"]}
IN_PROCESS = """
import sys, time
from configs import load_config
from costmodel.answers.predict import predict
from costmodel.answers.prediction_report import format_table
t = time.perf_counter()
format_table(predict(load_config(sys.argv[1]), "h800"))
print(time.perf_counter() - t)
"""


def _wall(tree: Path, argv: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run([str(PY), "-m", "mhcpipe", *argv], cwd=tree, check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": str(tree)})
    return time.perf_counter() - t


def _in_process(tree: Path, preset: str) -> float:
    out = subprocess.run([str(PY), "-c", IN_PROCESS, preset], cwd=tree, check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(tree)})
    return float(out.stdout.strip().splitlines()[-1])


def measure(trees: list[Path], repeat: int, tune_repeat: int) -> list[dict]:
    """Per tree, each measure's median; the trees take turns within every repetition."""
    times: list[dict[str, list[float]]] = [{} for _ in trees]

    def turns(key: str, n: int, run) -> None:
        for _ in range(n):
            for k, tree in enumerate(trees):
                times[k].setdefault(key, []).append(run(tree))

    for name, argv in PREDICTS.items():
        turns(f"predict {name} wall s", repeat, lambda tree, argv=argv: _wall(tree, ["predict", *argv]))
        turns(f"predict {name} in-process s", repeat, lambda tree, name=name: _in_process(tree, name))
    for name, argv in TUNES.items():
        turns(f"tune {name} wall s", tune_repeat, lambda tree, argv=argv: _wall(tree, ["tune", *argv]))
    return [{key: statistics.median(v) for key, v in t.items()} for t in times]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", help="also measure this git revision (a scratch worktree)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tune-repeat", type=int, default=3)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "costmodel_speed.json")
    args = ap.parse_args()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    result = {"machine": f"{os.cpu_count()} CPUs", "repeat": args.repeat, "tune_repeat": args.tune_repeat,
              "runs": {}}
    trees = [(head.strip() + " (this tree)", ROOT, None)]
    scratch = None
    if args.rev:
        scratch = Path(tempfile.mkdtemp(prefix="costmodel_speed_"))
        subprocess.run(["git", "worktree", "add", "--detach", str(scratch / "tree"), args.rev], cwd=ROOT, check=True,
                       capture_output=True)
        trees.insert(0, (args.rev, scratch / "tree", scratch))
    try:
        for (label, _, _), got in zip(trees, measure([tree for _, tree, _ in trees], args.repeat, args.tune_repeat)):
            result["runs"][label] = got
    finally:
        if scratch is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(scratch / "tree")], cwd=ROOT,
                           capture_output=True)
    labels = list(result["runs"])
    print(f"{'measure':<32}" + "".join(f"{lab[:22]:>24}" for lab in labels))
    for key in result["runs"][labels[0]]:
        print(f"{key:<32}" + "".join(f"{result['runs'][lab][key]:>24.2f}" for lab in labels))
    args.json.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
