"""Multi-GPU check: every schedule x {pp=N, pp=N/2 x dp=2 x ep=2} for a few steps on NCCL, losses against gloo.

    python bench/gpu_multi.py --gpus 8 --out OUT/multi.json            # a node with >= 8 GPUs: NCCL vs gloo (CPU)
    python bench/gpu_multi.py --gpus 2 --cpu --out F.json              # plumbing on CPU: both sides gloo

Shape letters: N processes (one GPU each), P pipeline ranks, D data-parallel replicas, EP expert-parallel ranks,
M micro-batches of the global batch.

For each schedule (gpipe 1f1b zb1p dualpipe dualpipev) and layout
* `pp=N`: a pure pipeline of N ranks (EP=1: every rank routes its own tokens, the count read is local);
* `pp=N/2 dp=2 ep=2`: N/2 pipeline ranks x 2 replicas, the experts of every stage split over the 2 replicas
  (all-to-all token exchange inside dp);
the same job runs twice with torchrun (`--nproc-per-node N -m pipeline ... --steps 3`): `--device cuda` (one GPU
per rank, NCCL) and `--device cpu` (gloo). Rank 0 prints one line per step (`step 1/3  loss 4.123456 ...`,
pipeline/runtime/train.py StepStats.line); the losses of the two runs must agree step by step to |a - b| <= 1e-4 |b|.

The model (`--size large`, the default on GPUs) is built to meet NCCL where gloo cannot show it: float64, mHC
n=4, C=512, 1024 tokens per micro-batch, so one stage message (n x T x C x 8 bytes) is 16 MiB, four times NCCL's
default 4 MiB channel buffer (NCCL_BUFFSIZE): a send then completes only while its receive runs (rendezvous), as
the runtime's posting order must allow; and 3 MoE blocks in every stage (8 experts top-2 + a shared one, no dense
block), so an overlapped DualPipe pair reads expert counts while the other micro-batch's P2P is in flight (the
count-read stall of issue 44 needs >= 3 such reads per stage). Blocks: 3 per stage, so 3P for gpipe/1f1b/zb1p and
6P for DualPipe's 2P stages. `--size small` (the default with `--cpu`) is the same structure at tiny-moe's shapes.
Why the tolerance: both sides run float64, but the CUDA run computes with other kernels (cuBLAS) than the CPU run
(CPU BLAS) and NCCL and gloo reduce in other orders: ~1e-12 relative after 3 AdamW steps; 1e-4 flags a wrong
result, not rounding. M = 2 P D (every schedule's M >= 2P per replica).
A layout that cannot run at this N (DualPipe on an odd pp, pp = N/2 < 1) is skipped with the reason; any other
layout error is a FAIL.
`--cpu`: the "nccl" side also runs on gloo (--device cpu), for checking this script on a machine without GPUs (the
two sides then compute the same thing; the comparison only proves the plumbing).
Writes the JSON (--out), one log per run (--workdir/logs) and prints one table.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout that is not installed

from schedules.registry import names  # noqa: E402 - ROOT is on sys.path above

SCHEDULES = names()
REL_TOL = 1e-4
STEP_LINE = re.compile(r"^step (\d+)/(\d+)\s+loss ([-\d.eE+naif]+)", re.M)
WHY_TOL = ("|a-b| <= 1e-4 |b|: float64 on both sides; cuBLAS vs CPU BLAS and NCCL vs gloo reductions sum in other "
           "orders (~1e-12 rel over 3 steps)")
# The model of each size: (hidden, heads x head_dim, expert hidden, micro-batch size, seq_len). large: one stage
# message n x T x C x 8 B = 4 x 1024 x 512 x 8 = 16 MiB > NCCL's 4 MiB buffers.
SIZES = {"large": dict(hidden=512, num_heads=8, head_dim=64, expert_hidden=128, microbatch_size=1, seq_len=1024),
         "small": dict(hidden=64, num_heads=4, head_dim=16, expert_hidden=32, microbatch_size=2, seq_len=32)}
MOE_BLOCKS_PER_STAGE = 3


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, required=True, help="N: processes, one GPU each (even, >= 2)")
    ap.add_argument("--cpu", action="store_true", help="both sides on gloo (--device cpu): plumbing check")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated (default: all five)")
    ap.add_argument("--layouts", default="pp,ppdpep", help="'pp' (pp=N), 'ppdpep' (pp=N/2 dp=2 ep=2); default both")
    ap.add_argument("--size", choices=sorted(SIZES), default=None,
                    help="model size: large (16 MiB stage messages; default on GPUs) or small (default with --cpu)")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per run (default 3)")
    ap.add_argument("--run-timeout", type=float, default=300.0, help="seconds per torchrun job (default 300)")
    ap.add_argument("--workdir", type=Path, default=None, help="configs and logs (default: next to --out)")
    ap.add_argument("--out", type=Path, default=None, help="JSON (default bench/results/multi_<N>.json)")
    ap.add_argument("--python", default=sys.executable, help="interpreter for torchrun (default: this one)")
    args = ap.parse_args(argv)
    if args.gpus < 2 or args.gpus % 2:
        ap.error(f"--gpus {args.gpus}: must be even and >= 2 (the dp=2 layout halves it)")
    args.schedule_list = [s.strip() for s in args.schedules.split(",") if s.strip()]
    bad = [s for s in args.schedule_list if s not in SCHEDULES]
    if bad:
        ap.error(f"--schedules: unknown {bad}; choose among {', '.join(SCHEDULES)}")
    args.layout_list = [s.strip() for s in args.layouts.split(",") if s.strip()]
    if any(s not in ("pp", "ppdpep") for s in args.layout_list):
        ap.error("--layouts: use pp and/or ppdpep")
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    if args.size is None:
        args.size = "small" if args.cpu else "large"
    if args.out is None:
        args.out = ROOT / "bench" / "results" / f"multi_{args.gpus}{'_cpu' if args.cpu else ''}.json"
    if args.workdir is None:
        args.workdir = args.out.parent / f"multi_{args.gpus}"
    return args


def layouts(n: int, wanted: list[str]) -> list[dict]:
    out = []
    if "pp" in wanted:
        out.append({"key": "pp", "label": f"pp={n}", "pp": n, "dp": 1, "ep": 1})
    if "ppdpep" in wanted:
        out.append({"key": "ppdpep", "label": f"pp={n // 2} dp=2 ep=2", "pp": n // 2, "dp": 2, "ep": 2})
    return out


def stages_of(schedule: str, pp: int) -> int:
    """Pipeline stages of a schedule on pp ranks: DualPipe and DualPipeV place two stages on each rank."""
    from schedules.registry import kind_of

    return kind_of(schedule).held_per_rank * pp


def stage_message_bytes(size: str, n: int = 4) -> int:
    """Bytes of one stage-boundary activation: n streams x tokens of a micro-batch x hidden, float64."""
    z = SIZES[size]
    return n * z["microbatch_size"] * z["seq_len"] * z["hidden"] * 8


def write_config(lay: dict, workdir: Path, size: str = "small", schedule: str = "dualpipev") -> Path:
    """tiny-moe's structure at this size: 3 MoE blocks in each of the schedule's stages, M = 2 P D, float64."""
    from configs import load_config, parse_config

    data = load_config("tiny-moe").model_dump(mode="json")
    z = SIZES[size]
    stages = stages_of(schedule, max(lay["pp"], 1))
    m = data["model"]
    m.update(num_blocks=MOE_BLOCKS_PER_STAGE * stages, hidden=z["hidden"], num_heads=z["num_heads"],
             head_dim=z["head_dim"], mlp_hidden=2 * z["hidden"], name=f"multi-{size}")
    m["moe"].update(expert_hidden=z["expert_hidden"], first_dense_blocks=0)
    data["parallel"].update(schedule=schedule, ranks=max(lay["pp"], 1), data_parallel=lay["dp"],
                            expert_parallel=lay["ep"], microbatches=2 * max(lay["pp"], 1) * lay["dp"],
                            microbatch_size=z["microbatch_size"], seq_len=z["seq_len"])
    data["train"]["dtype"] = "float64"
    path = workdir / "configs" / f"{size}_{lay['key']}_{schedule}.yaml"
    parse_config(data, str(path))  # fail here, not in torchrun
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def cannot_run(schedule: str, lay: dict, n: int) -> str | None:
    """Why this layout cannot run at this N at all (None: it can)."""
    if lay["pp"] < 1:
        return f"pp = N/2 = {lay['pp']} < 1"
    if schedule == "dualpipe" and lay["pp"] % 2:
        return f"dualpipe needs an even pp (pp={lay['pp']} at N={n})"
    return None


def skip_reason(schedule: str, lay: dict, cfg_path: Path, n: int) -> str | None:
    """Why this layout cannot run at this N (None: it can); raises ValueError for any other layout error."""
    reason = cannot_run(schedule, lay, n)
    if reason is not None:
        return reason
    from pipeline.__main__ import add_run_arguments
    from pipeline.launch.run_args import config_from_args

    p = argparse.ArgumentParser()
    add_run_arguments(p)
    a = p.parse_args(["--config", str(cfg_path), "--schedule", schedule, "--pp", str(lay["pp"]), "--dp",
                      str(lay["dp"]), "--ep", str(lay["ep"]), "--steps", "3", "--device", "cpu"])
    config_from_args(a, n)  # the launcher's own checks (layout vs world, M rules): ValueError = a real failure
    return None


_RUNNING: list = [None]  # the torchrun job in flight (its own session: stopped as a whole)


def _stop(proc) -> None:
    """SIGTERM to the job's whole process group (torchrun and its workers), SIGKILL after 10 s."""
    import signal

    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _on_term(signum, _frame) -> None:
    """gpu_check.sh's `timeout` stops this script: take the running torchrun job (another session) with it."""
    if _RUNNING[0] is not None:
        _stop(_RUNNING[0])
    sys.exit(128 + signum)


def run_job(args, schedule: str, lay: dict, cfg_path: Path, device: str, log: Path) -> dict:
    n = args.gpus
    cmd = [args.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), "-m", "pipeline",
           "--config", str(cfg_path), "--schedule", schedule, "--pp", str(lay["pp"]), "--dp", str(lay["dp"]),
           "--ep", str(lay["ep"]), "--steps", str(args.steps), "--device", device]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    if device == "cpu":
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write("+ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        _RUNNING[0] = proc
        try:
            rc = proc.wait(timeout=args.run_timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            rc = "timeout"
        finally:
            _RUNNING[0] = None
    text = log.read_text(errors="replace")
    losses = {int(k): float(v) for k, _, v in STEP_LINE.findall(text)}
    return {"rc": rc, "seconds": round(time.perf_counter() - t0, 1), "losses": [losses.get(k) for k in
                                                                              range(1, args.steps + 1)],
            "log": str(log), "tail": text.strip().splitlines()[-3:] if rc != 0 else []}


def compare(a: list, b: list) -> tuple[float | None, list[str]]:
    problems, worst = [], 0.0
    for k, (x, y) in enumerate(zip(a, b), 1):
        if x is None or y is None:
            problems.append(f"step {k}: no loss line ({'nccl' if x is None else 'gloo'} side)")
            continue
        if x != x or y != y:  # NaN
            problems.append(f"step {k}: NaN loss")
            continue
        rel = abs(x - y) / abs(y) if y else abs(x - y)
        worst = max(worst, rel)
        if rel > REL_TOL:
            problems.append(f"step {k}: {x:.6f} vs {y:.6f} (rel {rel:.1e} > {REL_TOL:.0e})")
    return (worst if not any("no loss" in p or "NaN" in p for p in problems) else None), problems


def table(res: dict) -> str:
    n, side = res["gpus"], res["nccl_side"]
    lines = [f"multi-GPU check, N={n}: '{side}' vs 'cpu/gloo', {res['steps']} steps each, model '{res['size']}' "
             f"(stage message {res['stage_message_bytes'] / 2**20:.2f} MiB, {res['moe_blocks_per_stage']} MoE "
             f"blocks per stage); tolerance {WHY_TOL}"]
    w = max([len(r["layout"]) for r in res["rows"]] + [6])
    lines.append(f"{'schedule':<10} {'layout':<{w}}  {'status':<6} {'max rel':>8}  {'nccl losses':<30} "
                 f"{'gloo losses':<30} s")
    for r in res["rows"]:
        fmt = lambda ls: " ".join("-" if v is None else f"{v:.6f}" for v in ls) if ls else "-"  # noqa: E731
        rel = "-" if r.get("max_rel") is None else f"{r['max_rel']:.1e}"
        extra = ""
        if r["status"] == "SKIP":
            extra = f"  ({r['reason']})"
        elif r["status"] != "ok":
            extra = f"  ({'; '.join(r['problems'])[:200]})"
        secs = sum(r.get(k, {}).get("seconds", 0) for k in ("nccl", "gloo"))
        lines.append(f"{r['schedule']:<10} {r['layout']:<{w}}  {r['status']:<6} {rel:>8}  "
                     f"{fmt(r.get('nccl', {}).get('losses')):<30} {fmt(r.get('gloo', {}).get('losses')):<30} "
                     f"{secs:.0f}{extra}")
    c = res["counts"]
    lines.append(f"{c['ok']} ok, {c['fail']} FAIL, {c['skip']} skipped of {len(res['rows'])} (schedule, layout); "
                 f"{res['seconds']:.0f} s")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    n = args.gpus
    if not args.cpu:
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < n:
            print(f"bench/gpu_multi.py: error: --gpus {n} needs {n} CUDA devices, this machine has {have} "
                  "(use --cpu for a plumbing check on gloo)", file=sys.stderr)
            return 2
    import signal

    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, _on_term)
    nccl_device = "cpu" if args.cpu else "cuda"
    t0 = time.perf_counter()
    rows = []
    lays = layouts(n, args.layout_list)
    for schedule in args.schedule_list:
        for lay in lays:
            row = {"schedule": schedule, "layout": lay["label"], "size": args.size,
                   "pp": lay["pp"], "dp": lay["dp"], "ep": lay["ep"]}
            rows.append(row)
            try:
                reason = cannot_run(schedule, lay, n)
                if reason is None:
                    cfg = write_config(lay, args.workdir, args.size, schedule)
                    reason = skip_reason(schedule, lay, cfg, n)
            except ValueError as err:
                row.update(status="FAIL", problems=[f"layout refused: {err}"])
                print(f"[{schedule} {lay['label']}] FAIL: layout refused: {err}", flush=True)
                continue
            if reason is not None:
                row.update(status="SKIP", reason=reason)
                print(f"[{schedule} {lay['label']}] SKIP: {reason}", flush=True)
                continue
            tag = f"{schedule}_{lay['key']}"
            row["config"] = str(cfg)
            row["nccl"] = run_job(args, schedule, lay, cfg, nccl_device, args.workdir / "logs" / f"{tag}_nccl.log")
            row["gloo"] = run_job(args, schedule, lay, cfg, "cpu", args.workdir / "logs" / f"{tag}_gloo.log")
            problems = [f"{side} run exit {row[side]['rc']}: {' | '.join(row[side]['tail'])[:160]}"
                        for side in ("nccl", "gloo") if row[side]["rc"] != 0]
            rel, diffs = compare(row["nccl"]["losses"], row["gloo"]["losses"])
            row.update(max_rel=rel, problems=problems + diffs, status="ok" if not problems + diffs else "FAIL")
            print(f"[{schedule} {lay['label']}] {row['status']}: nccl {row['nccl']['losses']} gloo "
                  f"{row['gloo']['losses']} ({row['nccl']['seconds'] + row['gloo']['seconds']:.0f} s)", flush=True)
    counts = {"ok": sum(r["status"] == "ok" for r in rows), "fail": sum(r["status"] == "FAIL" for r in rows),
              "skip": sum(r["status"] == "SKIP" for r in rows)}
    res = {"gpus": n, "cpu_fallback": args.cpu, "size": args.size,
           "stage_message_bytes": stage_message_bytes(args.size), "moe_blocks_per_stage": MOE_BLOCKS_PER_STAGE,
           "nccl_side": "cpu/gloo (--cpu fallback)" if args.cpu else "cuda/NCCL",
           "steps": args.steps, "rel_tol": REL_TOL, "tolerance_why": WHY_TOL, "rows": rows, "counts": counts,
           "seconds": time.perf_counter() - t0, "ok": counts["fail"] == 0 and counts["ok"] > 0}
    text = table(res)
    res["table"] = text
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    (args.out.parent / (args.out.stem + "_table.txt")).write_text(text + "\n")
    print(text)
    print(f"wrote {args.out}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
