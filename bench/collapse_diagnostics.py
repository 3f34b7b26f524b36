"""Benchmark: do the stream-collapse diagnostics show LSS against copy-expand and HC against mHC on a short run?

    .venv/bin/python bench/collapse_diagnostics.py [--steps 200] [--every 25] [--lr 3e-3] [--out runs/collapse]
                                                   [--json bench/results/collapse_diagnostics.json]
    (the picture goes next to the JSON: bench/results/collapse_diagnostics.png)

The `tiny` model (8 blocks, C=64, n=4) on one CPU rank (1F1B, pp=1, M=8 micro-batches of 2 x 32 tokens) learns a
byte-level corpus: this repository's own .py and .md files in sorted order (vocab 256 = bytes), so the loss has
something to learn and falls. Three runs, each with `--diagnostics-every`: mHC with copy-expand and HC with
copy-expand in one job, one step of each in turn (`--interleave`), and mHC with LSS expansion (learned per-stream
scaling). `mhcpipe diagnose` merges each run's diagnostics; the table lists, at the first and the last logged
step: the largest per-stream RMS imbalance over depth, the imbalance at the exit, the largest read and write share
of one stream, the mean distance of H_res from the identity over the deeper half, and the composite Amax gains
(forward, backward) of the token-mean H_res over the model and the largest per-token stage composite. The two jobs
run at the same time (one core each).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.observability.diagnose import draw, load, summary  # noqa: E402


def corpus(path: Path) -> Path:
    """The repository's .py and .md files as one byte stream (deterministic: sorted paths)."""
    files = sorted(p for p in ROOT.rglob("*") if p.suffix in (".py", ".md") and ".venv" not in p.parts
                   and "runs" not in p.parts and p.is_file())
    data = b"".join(p.read_bytes() for p in files)
    np.save(path, np.frombuffer(data, dtype=np.uint8))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "collapse")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "collapse_diagnostics.json")
    args = ap.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    data = corpus(out / "corpus.npy")
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg["train"].update({"data": str(data), "lr": args.lr, "steps": args.steps})
    cfg_path = out / "tiny-bytes.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    common = [sys.executable, "-m", "mhcpipe", "run", "--config", str(cfg_path), "--pp", "1", "--schedule", "1f1b",
              "--diagnostics-every", str(args.every)]
    jobs = {"copy": common + ["--residual", "mhc:4", "--interleave", "hc:4", "--diagnostics-dir", str(out / "copy")],
            "lss": common + ["--residual", "mhc:4", "--expand", "lss", "--diagnostics-dir", str(out / "lss")]}
    started = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one core per job: two jobs with two threads each thrash
    procs = {k: subprocess.Popen(cmd, cwd=ROOT, stdout=(out / f"{k}.log").open("w"), stderr=subprocess.STDOUT,
                                 env=env) for k, cmd in jobs.items()}
    for k, p in procs.items():
        if p.wait() != 0:
            print(f"run {k} failed: see {out / f'{k}.log'}", file=sys.stderr)
            return 1
    wall = time.perf_counter() - started
    losses = {}
    for k in jobs:
        for line in (out / f"{k}.log").read_text().splitlines():
            if re.match(r"(\[\S+\] )?step \d+/\d+ +loss", line):
                tag = line.split("]")[0].lstrip("[") if line.startswith("[") else "mhc:4"
                label = f"{tag.replace(':', '_')}/{k}"
                losses.setdefault(label, []).append(float(line.split("loss")[1].split()[0]))
    runs = load([out / "copy" / "mhc_4", out / "copy" / "hc_4", out / "lss"],
                labels=["mHC copy", "HC copy", "mHC LSS"])
    png = draw(runs, args.json.with_suffix(".png"))  # stored next to the JSON (bench/results/)
    rows = [summary(r) for r in runs]
    print(f"{'run':10} {'loss first->last':>18} {'imb max':>16} {'imb exit':>16} {'read max':>14} "
          f"{'|Hres-I| deep':>16} {'gain fwd':>16} {'gain bwd':>16} {'stage gain bwd':>16}")
    loss_of = {"mHC copy": "mhc_4/copy", "HC copy": "hc_4/copy", "mHC LSS": "mhc_4/lss"}
    for r in rows:
        f, last, ls = r["first"], r["last"], losses.get(loss_of[r["label"]], [float("nan")])

        def pair(key, fmt="{:.3f}"):
            return f"{fmt.format(f[key])}->{fmt.format(last[key])}"

        print(f"{r['label']:10} {ls[0]:8.3f}->{ls[-1]:<8.3f} {pair('imbalance_max'):>16} "
              f"{pair('imbalance_out'):>16} {pair('read_share_max', '{:.2f}'):>14} "
              f"{pair('res_identity_dist_deep'):>16} {pair('gain_fwd'):>16} {pair('gain_bwd'):>16} "
              f"{pair('stage_gain_bwd_max'):>16}")
    result = {"command": "python bench/collapse_diagnostics.py " + " ".join(sys.argv[1:]), "steps": args.steps,
              "every": args.every, "lr": args.lr, "corpus_bytes": int(np.load(data).size), "wall_s": wall,
              "machine": platform.processor() or platform.machine(), "losses": losses, "runs": rows,
              "picture": str(png)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {args.json} and {png} ({wall:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
