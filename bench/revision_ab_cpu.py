"""Benchmark: this tree's pipeline step time against an earlier git revision's, on gloo ranks, launches
alternating (old, new, new, old, ...) so both see the same drift of a shared machine's speed.

    .venv/bin/python bench/revision_ab_cpu.py --rev 6ee54ad [--config tiny] [--ranks P] [--launches 6]
        [--steps 30] [--warmup 5] [--out bench/results/revision_ab_cpu.json]

The revision is checked out with `git worktree` under runs/rev_<rev>/ and run with this venv's Python (the
revision must accept the same config). Each launch trains `--steps` steps (plain gloo semantics, no recording)
and reports the median of its slowest-rank step times after the warm-up; the table gives each side's median
over its launches and the median of the per-pair ratios new/old (launch pairs ran next to each other).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_ONE_LAUNCH = r"""
import json, statistics, sys
from configs import load_config
from pipeline.launch.local import launch, variants_worker
cfg = load_config(sys.argv[1]).model_dump()
cfg["train"]["steps"] = int(sys.argv[2])
if int(sys.argv[3]) > 0:
    cfg["parallel"]["ranks"] = int(sys.argv[3])
if "comm_rules" in cfg["train"]:
    cfg["train"]["comm_rules"] = "backend"
world = cfg["parallel"]["ranks"] * cfg["parallel"]["data_parallel"]
res = launch(variants_worker, world, ([cfg], False), timeout_s=600)
bad = [(r.rank, r.error) for r in res if r.exitcode != 0]
if bad:
    raise SystemExit(f"ranks failed: {bad}")
times = [s["step_time_s"] for s in res[0].value[0]["stats"]]
print(json.dumps(times))
"""


def one_launch(tree: Path, config: str, steps: int, ranks: int = 0) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop("MHCPIPE_COMM_RULES", None)
    env.pop("MHCPIPE_TRANSPORT", None)  # the spelling of revisions before the one switch
    out = subprocess.run([sys.executable, "-c", _ONE_LAUNCH, config, str(steps), str(ranks)], cwd=tree, env=env,
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"revision_ab_cpu: launch in {tree} failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", required=True, help="the git revision to compare with (e.g. the last landed commit)")
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--ranks", type=int, default=0,
                    help="pipeline ranks (default: the config's; 2 gives each rank a core of a 2-core host)")
    ap.add_argument("--launches", type=int, default=6, help="launches per side")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "revision_ab_cpu.json")
    args = ap.parse_args()
    if args.steps <= args.warmup or args.launches < 1:
        print("revision_ab_cpu: need --steps > --warmup and --launches >= 1", file=sys.stderr)
        return 2
    rev = subprocess.run(["git", "rev-parse", "--short", args.rev], cwd=ROOT, capture_output=True, text=True)
    if rev.returncode != 0:
        print(f"revision_ab_cpu: --rev {args.rev}: not a revision of this repository", file=sys.stderr)
        return 2
    rev = rev.stdout.strip()
    old = ROOT / "runs" / f"rev_{rev}"
    if not old.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(old), rev], cwd=ROOT, check=True,
                       capture_output=True)
    sides = {"old": [], "new": []}
    for k in range(args.launches):
        for side in (("old", "new") if k % 2 == 0 else ("new", "old")):
            times = one_launch(old if side == "old" else ROOT, args.config, args.steps, args.ranks)
            sides[side].append(statistics.median(times[args.warmup:]))
            print(f"launch {k + 1} {side}: median step {sides[side][-1] * 1e3:.1f} ms", flush=True)
    med = {s: statistics.median(v) for s, v in sides.items()}
    ratios = [n / o for n, o in zip(sides["new"], sides["old"])]
    ratio = statistics.median(ratios)
    print(f"{'side':<6}{'median step ms':>16}   launches")
    for s, v in sides.items():
        print(f"{s:<6}{med[s] * 1e3:>16.1f}   " + " ".join(f"{x * 1e3:.0f}" for x in v))
    print(f"new/old per launch pair: median {ratio:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}); "
          f"{os.cpu_count()} cores")
    out = {"rev": rev, "config": args.config, "ranks": args.ranks or "config", "launches": args.launches,
           "steps": args.steps, "warmup": args.warmup,
           "median_step_s": med, "launch_medians_s": sides, "ratio_new_over_old": ratio, "ratios": ratios,
           "cores": os.cpu_count(), "command": "bench/revision_ab_cpu.py " + " ".join(sys.argv[1:])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
