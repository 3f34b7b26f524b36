"""Predicted vs measured on this machine: calibrate `local` for the tiny config, predict, run, compare.

    .venv/bin/python bench/predict_local.py [--reuse] [--steps 8] [--repeat 1] [--sequential]
                                           [--out runs/bench/predict_local]

1. Host micro-benchmarks (costmodel.fitting.calibrate.calibrate_local --quick: matmul/copy sweeps, launch costs,
2-process
   gloo P2P alpha-beta); --reuse keeps an existing runs/hardware/local.json for this part.
2. `--repeat` times: run the BASELINE (n = 1) and mHC (n = 4) on the config's 4 gloo ranks, interleaved step by
   step in one launch (A B B A ...: on a shared host whose speed drifts within seconds, both see the same drift;
   `--sequential`: the baseline run, then the mHC run after the prediction); runtime calibration on the baseline
   trace alone (costmodel.local.calibration.calibrate_local_for: micro-benchmarks of a one-block middle stage
   through the runtime's Stage code, baseline and mHC (pipeline.launch.host_measurements), cores(k), plus the baseline
   run); predict(cfg, hw) for the baseline (a replay of the run just measured) and mHC n = 4; compare. The mHC
   run is never an input (costmodel.md §3). `--steps` steps per run, the first dropped. traces.analysis.compare per
   run: step time (makespan of the schedule spans), per-kind errors, overhead in pp; also the runtime's own
   reported step time (max over ranks, incl. optimizer).
Prints a table and writes bench/results/predict_local.json. Targets (issue 5): mHC step within 15 %, per-kind
median error within 20 % (compute kinds F, I, W, B, FB; reported as the signed median, i.e. the model's bias,
and as the median |error|, which adds the scatter of single actions; SEND/RECV are reported apart: measured comm
spans run from post to the wait's return, so they include waiting and are not transfer times). With --repeat >= 2
it also prices an out-of-run oracle: each action of run i predicted from the same action's times in the other runs,
which shows how low the median |error| of a prediction made before the run can go on this host.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COMPUTE = ("F", "I", "W", "B", "FB")
COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


def oracle_trace(meas):
    """One step of `meas` with every action lasting its own median over the measured steps: an oracle prediction.
    Compared with `meas`, its per-kind median |error| is the run's own scatter, the floor for any one-number-per-
    action prediction."""
    from dataclasses import replace

    from traces.analysis.matching import span_key, step_index
    from traces.trace import Trace

    steps = step_index(meas)
    durations: dict = {}
    for i in steps:
        durations.setdefault(span_key(meas.spans[i]), []).append(meas.spans[i].duration)
    first = [meas.spans[i] for i, k in steps.items() if k == 0]
    return Trace([replace(s, duration=statistics.median(durations[span_key(s)])) for s in first],
                 {**meas.meta, "source": "oracle"})


def out_of_run_oracle(pred, others, q: float):
    """`pred` with every action lasting the q-quantile of the same action's durations in `others` (the other
    measured runs of the batch, never the one it is compared with): a prediction made before the run by someone
    who knew how every single action behaved in the other runs."""
    from dataclasses import replace

    import numpy as np

    from traces.analysis.matching import span_key
    from traces.trace import Trace

    pooled: dict = {}
    for t in others:
        for s in t.spans:
            pooled.setdefault(span_key(s), []).append(s.duration)
    spans = [replace(s, duration=float(np.quantile(pooled[span_key(s)], q))) if span_key(s) in pooled else s
             for s in pred.spans]
    return Trace(spans, {**pred.meta, "source": "oracle"})


def out_of_run_floor(preds, meas_runs) -> list[dict]:
    """Per run and compute kind, the median |error| of out_of_run_oracle: with the median (q = 0.5), and with the
    quantile that is best for that kind on the run itself (hindsight, q = 0.05 ... 0.95): what no prediction made
    before the run can beat by much when single actions' times are random."""
    from traces.analysis.compare import compare

    out = []
    for i, (pred, meas) in enumerate(zip(preds, meas_runs)):
        others = [m for j, m in enumerate(meas_runs) if j != i]
        by_q = {q: {k.kind: k.median_abs_pct for k in compare(out_of_run_oracle(pred, others, q), meas).kinds}
                for q in [round(0.05 * j, 2) for j in range(1, 20)]}
        out.append({kind: {"median_q": by_q[0.5][kind], "best_q": min(v[kind] for v in by_q.values())}
                    for kind in COMPUTE if kind in by_q[0.5]})
    return out


def kind_table(c) -> dict:
    return {k.kind: {"n": k.n, "signed_median_pct": k.signed_median_pct, "median_abs_pct": k.median_abs_pct,
                     "p90_abs_pct": k.p90_abs_pct, "pred_mean_us": k.pred_mean_us, "meas_mean_us": k.meas_mean_us}
            for k in c.kinds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reuse", action="store_true", help="reuse runs/hardware/local.json for the host part")
    ap.add_argument("--steps", type=int, default=8, help="steps per run (the first is dropped); the VM's speed "
                    "switches within seconds, so longer runs average it out")
    ap.add_argument("--repeat", type=int, default=1, help="measured runs per variant")
    ap.add_argument("--no-overlap", action="store_true", help="F&B pairs serial (parallel.overlap false), as the "
                    "runtime ran them before the overlapped pair")
    ap.add_argument("--sequential", action="store_true", help="run the baseline, then mHC, as two launches "
                    "(default: one launch, the two interleaved step by step)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench" / "predict_local"))
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "predict_local.json"))
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--residual", default="mhc:4", help="the residual predicted and measured against residual:1, "
                    "e.g. xhc:16:4 or mhc-sp:4 (default mhc:4; --json then defaults to predict_local_<variant>.json)")
    args = ap.parse_args()

    from costmodel.fitting.calibrate import calibrate_local
    from costmodel.physics.hardware import HardwareSpec, local_profile_path
    from costmodel.local.calibration import calibrate_local_for
    from costmodel.local.host_pricing import HostPricing
    from costmodel.answers.predict import predict, residual_spec_of
    from pipeline.launch.run_args import with_residual_flag
    from pipeline.launch.host_measurements import block_round, run_runtime, run_runtime_interleaved, time_stage_pieces
    from configs import load_config
    from traces.analysis.compare import compare
    from traces.analysis.matching import drop_warmup_step

    t_start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config("tiny", {"train": {"steps": args.steps}, "parallel": {"overlap": not args.no_overlap}})
    cfg = with_residual_flag(cfg, "--residual", args.residual)
    base_cfg = cfg.with_residual("residual", 1)
    n, variant = cfg.model.residual.n, cfg.model.residual.variant
    if args.residual != "mhc:4" and args.json == str(ROOT / "bench" / "results" / "predict_local.json"):
        args.json = str(ROOT / "bench" / "results" / f"predict_local_{variant}.json")

    profile = local_profile_path()
    print("[1/2] host micro-benchmarks" + (" (reused)" if args.reuse and profile.exists() else ""))
    if args.reuse and profile.exists():
        host = json.loads(profile.read_text())
        host.pop("runtime", None)  # the host part only; the runtime part is refitted below
        hw0 = HardwareSpec.model_validate(host)
    else:
        hw0 = calibrate_local(quick=True)
    print(f"      P2P alpha {hw0.intra.latency_us:.0f} us, bw {hw0.intra.bandwidth / 1e9:.2f} GB/s, "
          f"{hw0.host_cores} cores")

    # Each repeat calibrates on its own baseline run and predicts the mHC run measured with it, so a change of the
    # machine's speed between repeats (shared VMs) does not leak into the prediction. The mHC run is never an input.
    protocol = ("baseline run -> runtime calibration on it -> prediction -> mHC run" if args.sequential else
                "baseline and mHC interleaved in one run -> runtime calibration on the baseline -> prediction")
    print(f"[2/2] {args.repeat} x ({protocol} -> compare), {args.steps} steps per variant, first step dropped")
    runs, cal = [], None
    for rep in range(args.repeat):
        t0 = time.time()
        dirs = (out / f"measured_baseline_{rep}", out / f"measured_mhc_{rep}")
        if args.sequential:
            tr_b, st_b = run_runtime(base_cfg, dirs[0], args.steps, args.timeout)
        else:
            (tr_b, st_b), (tr_m, st_m) = run_runtime_interleaved([base_cfg, cfg], dirs, args.steps, args.timeout)
        stage_us = time_stage_pieces(cfg, [(variant, n)])
        hw = calibrate_local_for(cfg, hardware=hw0, baseline_trace=tr_b, stage_us=stage_us, workload=block_round)
        hw.save(profile)
        hw.save(out / f"local_{rep}.json")  # this repeat's calibration, to re-price offline
        rt = hw.runtime
        if cal is None:
            cal = {"cores_by_concurrency": rt.cores_by_concurrency, "time_slice_us": rt.time_slice_us,
                   "protect_us": rt.protect_us,
                   "action_overhead_us": rt.action_overhead_us,
                   "p2p_latency_us": rt.p2p_latency_us, "block_bench_us": rt.meta["block_bench_us"],
                   "insitu_over_bench": rt.meta["insitu_over_bench"],
                   "mhc_extra_us_per_sublayer": rt.residual_us, "gloo_alpha_us": hw0.intra.latency_us,
                   "gloo_bw_gbs": hw0.intra.bandwidth / 1e9}
        w = rt.residual_us[f"{variant}:{n}"]
        # CPU runs the reference ops: unfused, except what has no unfused form (mhc-sp; xHC-Flash)
        spec = residual_spec_of(cfg, fused=variant == "mhc-sp" or (variant == "xhc" and cfg.model.residual.flash))
        pred = predict(cfg, hw, spec, profile_pricing=HostPricing())
        s = pred.summary
        pred.baseline.trace.save(out / f"predicted_baseline_{rep}.json")
        pred.mhc.trace.save(out / f"predicted_mhc_{rep}.json")
        factors = " ".join(f"{k} {v:.2f}" for k, v in rt.meta["insitu_over_bench"].items())
        print(f"      #{rep}: cores(k) {', '.join(f'{c:.2f}' for c in rt.cores_by_concurrency)}, time slice "
              f"{rt.time_slice_us / 1e3:.1f} ms, protection {rt.protect_us / 1e3:.1f} ms; in-pipeline / "
              f"micro-benchmark {factors}; executor gap {rt.action_overhead_us:.0f} us, P2P latency "
              f"{rt.p2p_latency_us:.0f} us; mHC extra per sub-layer F {w['fwd']:.0f} / I {w['bwd']:.0f} / "
              f"W {w['w']:.0f} us; predicted step baseline {s['iteration_us']['baseline'] / 1e3:.1f} ms, mHC "
              f"{s['iteration_us']['mhc'] / 1e3:.1f} ms")
        if args.sequential:
            tr_m, st_m = run_runtime(cfg, dirs[1], args.steps, args.timeout)
        meas = {"baseline": drop_warmup_step(tr_b), "mhc": drop_warmup_step(tr_m)}
        rt_steps = {"baseline": st_b[1:] if len(st_b) > 1 else st_b, "mhc": st_m[1:] if len(st_m) > 1 else st_m}
        print(f"      #{rep}: ran, calibrated, predicted in {time.time() - t0:.0f} s")
        cm = compare(pred.mhc.trace, meas["mhc"], baseline=(pred.baseline.trace, meas["baseline"]))
        cb = compare(pred.baseline.trace, meas["baseline"])
        floor = compare(oracle_trace(meas["mhc"]), meas["mhc"])
        runs.append({"mhc": cm, "baseline": cb, "floor": floor, "runtime_step_s": rt_steps, "prediction": s,
                     "pred_mhc": pred.mhc.trace, "meas_mhc": meas["mhc"]})
    oracle = (out_of_run_floor([r["pred_mhc"] for r in runs], [r["meas_mhc"] for r in runs])
              if len(runs) > 1 else [None] * len(runs))

    def pct(p, m):
        return 100.0 * (p - m) / m

    rows, result_runs = [], []
    for i, r in enumerate(runs):
        cm, cb = r["mhc"], r["baseline"]
        rs = {k: statistics.median(v) * 1e6 for k, v in r["runtime_step_s"].items()}
        result_runs.append({
            "baseline": {"pred_us": cb.makespan_pred_us, "meas_us": cb.makespan_meas_us,
                         "meas_min_us": cb.makespan_meas_min_us, "meas_max_us": cb.makespan_meas_max_us,
                         "err_pct": cb.makespan_err_pct, "runtime_step_us": rs["baseline"],
                         "kinds": kind_table(cb)},
            "mhc": {"pred_us": cm.makespan_pred_us, "meas_us": cm.makespan_meas_us,
                    "meas_min_us": cm.makespan_meas_min_us, "meas_max_us": cm.makespan_meas_max_us,
                    "err_pct": cm.makespan_err_pct, "runtime_step_us": rs["mhc"], "kinds": kind_table(cm)},
            "overhead": {"pred_pct": cm.overhead.pred_pct, "meas_pct": cm.overhead.meas_pct,
                         "diff_pp": cm.overhead.diff_pp},
            "steps_compared": cm.steps, "mhc_floor_kinds": kind_table(r["floor"]),
            "mhc_out_of_run_oracle_abs_pct": oracle[i]})
        rows.append((i, cb, cm, rs))

    print()
    print("run  variant   pred step   meas step (min-max)          err    runtime step   err")
    for i, cb, cm, rs in rows:
        for name, c in (("baseline", cb), ("mHC", cm)):
            rts = rs["baseline" if name == "baseline" else "mhc"]
            print(f"{i:<4} {name:<9} {c.makespan_pred_us / 1e3:8.1f} ms {c.makespan_meas_us / 1e3:8.1f} ms "
                  f"({c.makespan_meas_min_us / 1e3:6.1f}-{c.makespan_meas_max_us / 1e3:6.1f}) "
                  f"{c.makespan_err_pct:+6.1f}%  {rts / 1e3:8.1f} ms {pct(c.makespan_pred_us, rts):+6.1f}%")
        o = cm.overhead
        print(f"{i:<4} overhead  predicted {o.pred_pct:.0f}% vs measured {o.meas_pct:.0f}% ({o.diff_pp:+.0f} pp)")
    print()
    print("per-kind median error, mHC (signed / |e|; SEND/RECV measured = post..wait return, includes waiting)")
    kinds = [k for k in COMPUTE + COMM if any(k in rr["mhc"]["kinds"] for rr in result_runs)]
    print("run  " + "".join(f"{k:>16}" for k in kinds))
    for variant in ("mhc", "mhc_floor", "baseline"):
        if variant == "mhc_floor":
            print("mHC floor (an oracle predicting every action's own median over the run's steps: the run's "
                  "own scatter)")
        if variant == "baseline":
            print("baseline (replay: calibrated on this very run; shows how well the fit reproduces it)")
        for i, rr in enumerate(result_runs):
            line = f"{i:<4} "
            table = rr["mhc_floor_kinds"] if variant == "mhc_floor" else rr[variant]["kinds"]
            for k in kinds:
                e = table.get(k)
                line += f"{e['signed_median_pct']:+7.0f}/{e['median_abs_pct']:5.0f}%  " if e else " " * 16
            print(line)
    if oracle[0] is not None:
        print("out-of-run oracle, median |e| (every action predicted by its own times in the batch's other runs: "
              "their median / the quantile best for the kind in hindsight)")
        for i, rr in enumerate(result_runs):
            o = rr["mhc_out_of_run_oracle_abs_pct"]
            print(f"{i:<4} " + "".join(f"{o[k]['median_q']:7.0f}/{o[k]['best_q']:5.0f}%  " if k in o else " " * 16
                                       for k in kinds))

    def agg(path):
        vals = [path(rr) for rr in result_runs]
        return statistics.median(vals)

    summary = {
        "mhc_step_err_pct_median": agg(lambda rr: rr["mhc"]["err_pct"]),
        "baseline_step_err_pct_median": agg(lambda rr: rr["baseline"]["err_pct"]),
        "overhead_diff_pp_median": agg(lambda rr: rr["overhead"]["diff_pp"]),
        "mhc_kind_signed_median_pct": {k: agg(lambda rr, k=k: rr["mhc"]["kinds"][k]["signed_median_pct"])
                                       for k in COMPUTE if all(k in rr["mhc"]["kinds"] for rr in result_runs)},
        "mhc_kind_median_abs_pct": {k: agg(lambda rr, k=k: rr["mhc"]["kinds"][k]["median_abs_pct"])
                                    for k in COMPUTE if all(k in rr["mhc"]["kinds"] for rr in result_runs)},
    }
    # The "per-op-kind median error within 20%" read as the signed median (the model's bias per kind);
    # the median |e| also contains the run-to-run scatter of single actions, reported next to it.
    summary["mhc_floor_median_abs_pct"] = {
        k: agg(lambda rr, k=k: rr["mhc_floor_kinds"][k]["median_abs_pct"])
        for k in COMPUTE if all(k in rr["mhc_floor_kinds"] for rr in result_runs)}
    if oracle[0] is not None:
        summary["mhc_out_of_run_oracle_median_abs_pct"] = {
            k: {q: agg(lambda rr, k=k, q=q: rr["mhc_out_of_run_oracle_abs_pct"][k][q]) for q in ("median_q", "best_q")}
            for k in COMPUTE if all(k in rr["mhc_out_of_run_oracle_abs_pct"] for rr in result_runs)}
    summary["targets_met"] = {
        "mhc_step_within_15pct": abs(summary["mhc_step_err_pct_median"]) <= 15.0,
        "compute_kinds_signed_median_within_20pct":
            all(abs(v) <= 20.0 for v in summary["mhc_kind_signed_median_pct"].values()),
        "compute_kinds_median_abs_within_20pct": all(v <= 20.0 for v in summary["mhc_kind_median_abs_pct"].values())}
    print(f"\nmedian over runs: mHC step error {summary['mhc_step_err_pct_median']:+.1f}%; per-kind signed median "
          + ", ".join(f"{k} {v:+.0f}%" for k, v in summary["mhc_kind_signed_median_pct"].items())
          + "; per-kind median |e| "
          + ", ".join(f"{k} {v:.0f}%" for k, v in summary["mhc_kind_median_abs_pct"].items())
          + " (the runs' own scatter: "
          + ", ".join(f"{k} {v:.0f}%" for k, v in summary["mhc_floor_median_abs_pct"].items())
          + ")" + ("; out of run (best quantile in hindsight): " + ", ".join(
              f"{k} {v['best_q']:.0f}%" for k, v in summary["mhc_out_of_run_oracle_median_abs_pct"].items())
              if "mhc_out_of_run_oracle_median_abs_pct" in summary else "")
          + f"\ntargets met: {summary['targets_met']}")
    result = {"command": " ".join(["bench/predict_local.py"] + sys.argv[1:]), "config": "tiny",
              "residual": args.residual,
              "protocol": "sequential" if args.sequential else "interleaved",
              "schedule": "dualpipev", "ranks": cfg.parallel.ranks, "steps": args.steps, "repeat": args.repeat,
              "calibration_first_repeat": cal,
              "predictions": [{"iteration_us": r["prediction"]["iteration_us"],
                               "step_overhead_pct": r["prediction"]["step_overhead_pct"],
                               "pricing": r["prediction"]["pricing"],
                               "op_us": r["prediction"]["op_us"]} for r in runs],
              "runs": result_runs, "summary": summary, "wall_s": time.time() - t_start}
    jp = Path(args.json)
    jp.parent.mkdir(parents=True, exist_ok=True)
    jp.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {jp} ({time.time() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
