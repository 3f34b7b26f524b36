"""Predicted vs measured on this machine: calibrate `local`, predict the tiny config, run it, compare.

    .venv/bin/python bench/predict_local.py [--quick] [--reuse] [--ranks 4] [--steps 5] [--out runs/bench/predict_local]

1. Calibrate `local` (costmodel.calibrate: matmul and copy sweeps, launch costs, 2-process gloo P2P) and save the
   profile (runs/hardware/local.json unless $MHCPIPE_LOCAL_PROFILE). --reuse keeps an existing profile.
2. Predict the tiny preset (4 gloo ranks, DualPipeV) for the baseline (n = 1) and mHC (n = 4, the reference
   kernels the CPU runtime uses = the unfused pricing), and save both predicted traces.
3. If the runtime's entry exists (`python -m pipeline --config ... --trace-dir DIR`, writing DIR/trace.json),
   run both configs, compare each measured trace with its prediction (traces.compare: per-kind signed and
   absolute median error, makespan error over steady-state steps) and the overhead in percentage points.
   Targets (issue): step time within 15 %, per-op-kind median |error| within 20 %. Otherwise print exactly what
   is missing. Calibration never sees the runtime's traces (prediction, not replay).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def runtime_entry() -> tuple[list[str] | None, str]:
    """The command that runs a config, or None and why not."""
    if importlib.util.find_spec("pipeline.__main__") is None:
        return None, ("pipeline/__main__.py is missing: `python -m pipeline --config FILE --trace-dir DIR` "
                      "(the runtime entry of design.md) does not exist yet")
    probe = subprocess.run([sys.executable, "-m", "pipeline", "--help"], capture_output=True, text=True, cwd=ROOT,
                           timeout=120)
    if probe.returncode != 0 or "--trace-dir" not in probe.stdout:
        return None, ("`python -m pipeline --help` does not list --trace-dir (rc "
                      f"{probe.returncode}): {(probe.stdout + probe.stderr).strip()[-300:]}")
    return [sys.executable, "-m", "pipeline"], ""


def _train_worker(rank: int, world: int, cfg_dict: dict, trace_dir: str):
    """Fallback when the entry is missing: the runtime's own train() on a process group made by pipeline.local."""
    import torch

    from pipeline.config import parse_config
    from pipeline.train import train

    train(parse_config(cfg_dict), rank, world, torch.device("cpu"), trace_dir=Path(trace_dir), log=lambda *a: None)
    return None


def run_via_library(cfg_dict: dict, trace_dir: Path, timeout: int) -> Path:
    from pipeline.local import launch

    trace_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    launch(_train_worker, cfg_dict["parallel"]["ranks"], (cfg_dict, str(trace_dir)), timeout_s=timeout)
    print(f"    ran {cfg_dict['model']['residual']} via pipeline.local.launch + pipeline.train.train "
          f"in {time.time() - t0:.1f} s")
    trace = trace_dir / "trace.json"
    if not trace.exists():
        raise RuntimeError(f"the runtime wrote no {trace}")
    return trace


def run_measured(cmd: list[str], config: Path, trace_dir: Path, steps: int, timeout: int) -> Path:
    trace_dir.mkdir(parents=True, exist_ok=True)
    full = cmd + ["--config", str(config), "--trace-dir", str(trace_dir)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.time()
    proc = subprocess.run(full, capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(full)} failed (rc {proc.returncode}):\n{(proc.stdout + proc.stderr)[-2000:]}")
    print(f"    ran {config.name} in {time.time() - t0:.1f} s")
    trace = trace_dir / "trace.json"
    if not trace.exists():
        raise RuntimeError(f"{' '.join(full)} wrote no {trace}; found {sorted(p.name for p in trace_dir.iterdir())}")
    return trace


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="quick calibration (fewer sizes)")
    ap.add_argument("--reuse", action="store_true", help="reuse an existing local profile")
    ap.add_argument("--steps", type=int, default=6, help="training steps to measure (the first is dropped)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench" / "predict_local"))
    ap.add_argument("--timeout", type=int, default=900)
    args = ap.parse_args()

    import yaml

    from costmodel.calibrate import calibrate_local
    from costmodel.hardware import HardwareSpec, local_profile_path
    from costmodel.mhc_cost import ResidualSpec
    from costmodel.predict import predict
    from pipeline.config import load_config
    from traces.compare import compare
    from traces.trace import Trace

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile = local_profile_path()
    print("[1/3] calibrating local" + (" (reusing)" if args.reuse and profile.exists() else ""))
    if args.reuse and profile.exists():
        hw = HardwareSpec.load(profile)
    else:
        hw = calibrate_local(quick=args.quick, threads=1)
        hw.save(profile)
    cal = {"matmul_peak_gflops": hw.peak_flops["fp32"] / 1e9, "copy_peak_gbs": hw.hbm_bandwidth / 1e9,
           "launch_fwd_us": hw.launch_us, "launch_bwd_us": hw.backward_launch_us,
           "p2p_alpha_us": hw.intra.latency_us, "p2p_gbs": hw.intra.bandwidth / 1e9, "cores": hw.host_cores}
    print("      " + ", ".join(f"{k} {v:.3g}" for k, v in cal.items()) + f"  -> {profile}")

    print("[2/3] predicting tiny (baseline n=1 and mHC n=4, reference kernels = unfused pricing)")
    cfg = load_config("tiny", {"train": {"steps": args.steps}})
    pred = predict(cfg, hw, ResidualSpec("mhc", cfg.model.residual.n, fused=False))
    s = pred.summary
    pred.mhc.trace.save(out / "predicted_mhc.json")
    pred.baseline.trace.save(out / "predicted_baseline.json")
    print(f"      predicted step: baseline {s['iteration_us']['baseline'] / 1e3:.2f} ms, "
          f"mHC {s['iteration_us']['mhc'] / 1e3:.2f} ms, overhead {s['overhead_pct']:.1f}%")
    result = {"calibration": cal, "prediction": s}

    print("[3/3] measuring with the runtime")
    cmd, why = runtime_entry()
    library = cmd is None and importlib.util.find_spec("pipeline.train") is not None \
        and importlib.util.find_spec("pipeline.local") is not None
    if library:
        print(f"      {why}; falling back to pipeline.local.launch + pipeline.train.train")
    if cmd is None and not library:
        print(f"      NOT MEASURED: {why}.")
        print("      Needed: `python -m pipeline --config FILE.yaml --trace-dir DIR` that runs the config on its "
              "4 gloo ranks and writes DIR/trace.json (traces format, spans named F/s3/mb7 etc.).")
        result["measured"] = None
        result["missing"] = why
    else:
        data = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
        data.setdefault("train", {})["steps"] = args.steps
        measured = {}
        with tempfile.TemporaryDirectory(prefix="cm_bench_") as tmp:
            for name, residual in (("baseline", {"variant": "residual", "n": 1}), ("mhc", data["model"]["residual"])):
                d = json.loads(json.dumps(data))
                d["model"]["residual"] = residual
                path = Path(tmp) / f"tiny_{name}.yaml"
                path.write_text(yaml.safe_dump(d))
                if cmd is not None:
                    trace = run_measured(cmd, path, out / f"measured_{name}", args.steps, args.timeout)
                else:
                    trace = run_via_library(d, out / f"measured_{name}", args.timeout)
                measured[name] = Trace.load(trace)
        cmp = compare(pred.mhc.trace, measured["mhc"], baseline=(pred.baseline.trace, measured["baseline"]))
        cmp_b = compare(pred.baseline.trace, measured["baseline"])
        for label, c in (("baseline", cmp_b), ("mHC", cmp)):
            print(f"      {label}: step pred {c.makespan_pred_us / 1e3:.2f} ms vs meas {c.makespan_meas_us / 1e3:.2f} ms "
                  f"(min {c.makespan_meas_min_us / 1e3:.2f}, max {c.makespan_meas_max_us / 1e3:.2f}, "
                  f"{c.steps} steps): {c.makespan_err_pct:+.1f}%")
            for k in c.kinds:
                print(f"        {k.kind:<8} n={k.n:<5} signed median {k.signed_median_pct:+6.1f}%  "
                      f"median |e| {k.median_abs_pct:5.1f}%  p90 |e| {k.p90_abs_pct:5.1f}%")
        if cmp.overhead is not None:
            o = cmp.overhead
            print(f"      overhead: predicted {o.pred_pct:.1f}% vs measured {o.meas_pct:.1f}% ({o.diff_pp:+.1f} pp)")
        result["measured"] = {"mhc": cmp.to_dict(), "baseline": cmp_b.to_dict()}
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out / 'result.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
