"""`mhcpipe demo` (what `make demo` runs): predict, run, compare and show mHC's cost on this machine.

For the `tiny` preset on 4 CPU ranks with DualPipeV (configs/tiny.yaml):
  1. calibrate the `local` hardware spec (micro-benchmarks: matmul, copy, launch, 2-process gloo P2P);
  2. run mHC (n = 4) and the baseline (n = 1) in one torchrun job (gloo), one step of each in turn
     (`--interleave residual:1`: a shared machine's speed drifts within seconds, and both variants see the same
     drift), and record both traces;
  3. micro-benchmark one pipeline stage of the runtime with and without mHC at the config's shape, measure how
     the ranks share the cores, fit per-action costs on the BASELINE trace alone (calibration on a baseline run,
     costmodel.md §3 - the mHC run is never an input), predict baseline and mHC;
  4. compare predicted with measured, per op kind and as mHC overhead;
  5. write runs/demo/: report.md (with the critical path of a step, mHC's overhead along it, and a what-if
     replay of the mHC run without mHC), schedule.png (predicted above measured, one steady-state step, the
     critical path outlined in red), overhead.png, trace.json (Perfetto: predicted and measured processes,
     P2P arrows), the raw traces (measured/mhc_4/, measured/residual_1/, predicted_*.json).
`--schedule-only` keeps the old quick picture: DualPipe P=8, M=20 at unit costs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="predict, run, compare and draw mHC's cost on 4 CPU ranks (runs/demo/)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    p.add_argument("--config", default="tiny", help="preset or YAML (default tiny)")
    p.add_argument("--residual", default=None,
                   help="residual to measure against the plain residual (default: the config's, mhc:4 for tiny), "
                        "e.g. mhc-sp:4 or xhc:16:4")
    p.add_argument("--steps", type=int, default=8, help="training steps per run; the first is warm-up (a shared "
                   "VM changes speed within seconds: more steps average it out)")
    p.add_argument("--timeout", type=int, default=300, help="seconds allowed per torchrun launch")
    p.add_argument("--quick", action="store_true",
                   help="shorter host measurements (3 core-sharing cycles instead of 12, 10 stage rounds instead "
                        "of 40) for a quick check that the demo works on a machine; the prediction "
                        "is noisier")
    p.add_argument("--schedule-only", action="store_true",
                   help="only draw DualPipe P=8, M=20 at unit costs (seconds, no training)")
    p.set_defaults(func=run)


def _say(step: str, text: str) -> None:
    print(f"[{step}] {text}", flush=True)


def run_torchrun(config: str, residual: str, interleave: str, steps: int, trace_dir: Path, timeout: int,
                 ranks: int) -> list[str]:
    """One training job through torchrun (gloo on CPU) training `residual` and `interleave` in turn; the merged
    measured traces land in trace_dir/<variant>_<n>/. Returns the ranks' step lines."""
    from pipeline.launch.local import free_port

    trace_dir = trace_dir.resolve()
    trace_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "pipeline", "--config", config,
           "--residual", residual, "--interleave", interleave, "--steps", str(steps), "--device", "cpu",
           "--trace-dir", str(trace_dir)]
    log = trace_dir / "run.log"
    with log.open("w") as f:
        # the caller's working directory (a relative --config is the caller's), with the project importable from
        # wherever that is
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path})
    lines = [ln for ln in log.read_text().splitlines() if "] step " in ln]
    for ln in lines:
        print(f"      {ln}", flush=True)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-5:])
        raise RuntimeError(f"torchrun failed with exit {proc.returncode}; see {log}:\n{tail}")
    return lines


def last_step(trace):
    """The last recorded step of a measured trace, shifted to start at 0 (steady state, for pictures)."""
    from dataclasses import replace

    from traces.analysis.matching import step_index
    from traces.trace import Trace

    steps = step_index(trace)
    if not steps:
        return trace
    k = max(steps.values())
    chosen = [trace.spans[i] for i, s in steps.items() if s == k]
    t0 = min(s.start for s in chosen)
    return Trace(spans=[replace(s, start=s.start - t0) for s in chosen], meta=dict(trace.meta))


def _act_mib(pred, name: str) -> float:
    return max(m.activation_bytes + m.transient_bytes for m in pred.memory[name]) / 2**20


def _bubble(cmp) -> float:
    return sum(r.meas_bubble_pct for r in cmp.ranks) / max(1, len(cmp.ranks))


def measured_memory(lines: list[str], residual: str) -> tuple[str, str]:
    """(peak saved activations, peak RSS) of `residual`'s last step, as the runtime printed them (max over ranks)."""
    mine = [ln for ln in lines if ln.startswith(f"[{residual}] step ")]
    if not mine:
        return ("-", "-")
    words = mine[-1].split()
    return (" ".join(words[words.index("peak_act") + 1:][:2]), " ".join(words[words.index("peak_mem") + 1:][:2]))


def critical_path_section(mhc_cmp, base_cmp, whatif_mhc0: dict | None) -> list[str]:
    """The report's critical-path section: the chain that set the step time, predicted vs measured, mHC's overhead
    along it by cause, and the what-if replay of the mHC run without mHC."""
    from traces.analysis.path_report import compare_sections, to_markdown

    cp = mhc_cmp.critical_path
    meas, base = cp.get("meas"), base_cmp.critical_path.get("meas")
    if not meas:
        return ["## Critical path", "", "Not available: " + "; ".join(n for n in mhc_cmp.notes if "critical" in n), ""]
    mk = meas["makespan_us"]
    top = sorted(meas["by_kind"].items(), key=lambda kv: -kv[1])[:3]
    lines = ["## Critical path", "",
             "The chain of ops and transfers that set one step's time, across ranks "
             "(traces.analysis.critical_path: the "
             f"measured step with the median makespan, step {meas['step']} of {meas['steps']}; `mhcpipe critical-path` "
             "lists it op by op). Path length = time its ops ran; gaps = delays between them (launch, host and OS "
             "time: here 4 ranks share the machine's cores). schedule.png outlines in red the path of the step it "
             "draws (the last), trace.json has it as a `critical path` thread per rank.", "",
             f"Measured mHC step: {meas['length_us'] / 1e3:.1f} ms of ops on the path and "
             f"{meas['gaps_us'] / 1e3:.1f} ms "
             f"of gaps ({100 * meas['gaps_us'] / mk:.1f}%); most of the path is "
             + ", ".join(f"{k} {100 * v / mk:.1f}%" for k, v in top)
             + f"; exposed communication on the path {meas['exposed_comm_us'] / 1e3:.1f} ms "
             f"({100 * meas['exposed_comm_us'] / mk:.1f}%)."
             + (f" Baseline: {base['length_us'] / 1e3:.1f} ms of ops and {base['gaps_us'] / 1e3:.1f} ms of gaps."
                if base else ""), ""]
    if whatif_mhc0:
        w = whatif_mhc0
        b = base_cmp.makespan_meas_us
        lines += [f"What-if (`mhcpipe whatif measured/mhc_4/trace.json --scale mhc=0 --baseline "
                  f"measured/residual_1/trace.json`): replaying the mHC run without mHC's A/B share of each op "
                  f"predicts {w['step_us'] / 1e3:.1f} ms per step against {b / 1e3:.1f} ms measured for the baseline "
                  f"({100 * (w['step_us'] / b - 1):+.1f}%); the unscaled replay reproduces the mHC step to "
                  f"{w['reproduction_error_pct']:.1g}%. The replay keeps the mHC run's recorded delays between ops "
                  f"({w['critical_path_after']['gaps_us'] / 1e3:.1f} ms on the replayed path): delays a run with less "
                  "work would partly not have (fewer, shorter time slices lost to the other ranks).", ""]
    return lines + [to_markdown(compare_sections(cp), level="###")]


def write_report(path: Path, cfg, hw, pred, base_cmp, mhc_cmp, timings: dict, measured_mem: dict,
                 whatif_mhc0: dict | None = None) -> Path:
    from traces.analysis.report import to_markdown

    s = pred.summary
    o = mhc_cmp.overhead
    lines = [
        "# mhc-pipe demo: predicted vs measured mHC cost", "",
        f"Config `{cfg.model.name}`: {cfg.model.num_blocks} blocks, C={cfg.model.hidden}, "
        f"{cfg.parallel.schedule} on {cfg.parallel.ranks} CPU ranks (gloo), M={cfg.parallel.microbatches}, "
        f"T={cfg.parallel.tokens_per_microbatch} tokens per micro-batch, fp32. mHC: n={cfg.model.residual.n}, "
        f"{cfg.model.residual.sinkhorn_iters} Sinkhorn iterations, reference (unfused) kernels on CPU.",
        f"Hardware spec `local`: {hw.description}.", "",
        "## Headline", "",
        "| | predicted | measured | error |", "| --- | ---: | ---: | ---: |",
        f"| baseline step (n=1) | {base_cmp.makespan_pred_us / 1e3:.1f} ms | {base_cmp.makespan_meas_us / 1e3:.1f} ms "
        f"| {base_cmp.makespan_err_pct:+.1f}% |",
        f"| mHC step (n={cfg.model.residual.n}) | {mhc_cmp.makespan_pred_us / 1e3:.1f} ms | "
        f"{mhc_cmp.makespan_meas_us / 1e3:.1f} ms | {mhc_cmp.makespan_err_pct:+.1f}% |",
        f"| mHC overhead | {o.pred_pct:.1f}% | {o.meas_pct:.1f}% | {o.diff_pp:+.1f} pp |", "",
        "Measured step times are medians over the recorded steps after the first; baseline and mHC ran in one "
        "job, one step of each in turn. The baseline prediction is calibrated on the baseline trace (replay), "
        "the mHC prediction is not fitted to any mHC run.", "",
        "## Memory and bubble", "",
        "| | baseline | mHC |", "| --- | ---: | ---: |",
        f"| activations, predicted (max over ranks) | {_act_mib(pred, 'baseline'):.2f} MiB | "
        f"{_act_mib(pred, 'mhc'):.2f} MiB |",
        f"| saved activations, measured (max over ranks) | {measured_mem['baseline'][0]} | "
        f"{measured_mem['mhc'][0]} |",
        f"| peak memory per rank, predicted (state + activations) | {s['memory_gib']['baseline'] * 1024:.1f} MiB | "
        f"{s['memory_gib']['mhc'] * 1024:.1f} MiB |",
        f"| peak process memory (RSS), measured | {measured_mem['baseline'][1]} | {measured_mem['mhc'][1]} |",
        f"| bubble (idle share), predicted | {s['bubble']['baseline_pct']:.1f}% | {s['bubble']['mhc_pct']:.1f}% |",
        f"| bubble (idle share), measured | {_bubble(base_cmp):.1f}% | {_bubble(mhc_cmp):.1f}% |",
        "", "Measured RSS is the whole process: the Python interpreter and torch (about 400 MiB per process on "
        "CPU) and, since both variants train in the same processes, both models; the predicted total counts "
        "one variant's parameters, gradients, optimizer state and activations only. Predicted activations count "
        "what an optimized implementation stores (per tensor, Korthikanti et al.; mHC Table 3 for the streams); "
        "the measured ones are what eager autograd saves with the reference (unfused) kernels, so the two are "
        "not expected to agree closely.",
        "", (f"Recompute: mode `{cfg.recompute.mode}`, blocks L_r = {s.get('recompute_block')} sub-layers. "
             if cfg.recompute.mode != "off" else "Recompute: off. ") + f"Pricing: {s.get('pricing')}.", "",
    ]
    lines += critical_path_section(mhc_cmp, base_cmp, whatif_mhc0)
    lines += ["## Timings of this demo", ""]
    lines += [f"- {k}: {v:.1f} s" for k, v in timings.items()]
    lines += ["", "## mHC run: predicted vs measured (per op kind, bubble, overhead)", "",
              to_markdown(mhc_cmp).split("\n", 2)[2], "",
              "## Baseline run: predicted vs measured", "", to_markdown(base_cmp).split("\n", 2)[2]]
    path.write_text("\n".join(lines))
    return path


def predict_on_this_host(cfg, hw, base_trace, quick: bool):
    """Step 3: micro-benchmark one stage with and without the residual, measure how the ranks share the cores, fit
    the `local` spec on the baseline trace and predict baseline and mHC. Returns (fitted spec, prediction)."""
    from costmodel.local.calibration import calibrate_local_for
    from costmodel.local.core_sharing import measure_core_sharing
    from costmodel.local.host_pricing import HostPricing
    from costmodel.answers.predict import predict, residual_spec_of
    from pipeline.launch.host_measurements import block_round, time_stage_pieces

    res = cfg.model.residual
    stage_us = time_stage_pieces(cfg, [(res.variant, res.n)], rounds=10 if quick else 40)
    cores = measure_core_sharing(cfg, cfg.parallel.ranks, block_round, cycles=3 if quick else 12)
    hw = calibrate_local_for(cfg, hardware=hw, baseline_trace=base_trace, stage_us=stage_us, workload=block_round,
                             cores=cores)
    # CPU runs the reference ops: unfused, except what has no unfused form (mhc-sp; xHC-Flash is xHC's fused form)
    spec = residual_spec_of(cfg, fused=res.variant == "mhc-sp" or (res.variant == "xhc" and res.flash))
    return hw, predict(cfg, hw, spec, profile_pricing=HostPricing())


def draw(out: Path, cfg, predicted, measured, cmp) -> None:
    """Step 5's pictures: schedule.png (predicted above the last measured step), overhead.png, the Perfetto
    trace.json (with a `critical path` thread per rank, traces.drawing.path_marks) and comparison.json."""
    from traces.formats.chrome import to_chrome
    from traces.drawing.path_marks import chrome_path_events, paths_for
    from traces.drawing.overhead_chart import plot_overhead
    from traces.drawing.view import write_picture

    steady = last_step(measured)
    write_picture(out / "schedule.png", [predicted, steady], streams=("compute", "hp"),
                  title=f"{cfg.model.name} mHC n={cfg.model.residual.n}, {cfg.parallel.schedule} "
                        f"P={cfg.parallel.ranks}: predicted (top) vs measured (last step)")
    plot_overhead(cmp, out / "overhead.png")
    chrome = to_chrome(predicted, steady)
    chrome["traceEvents"] += chrome_path_events([predicted, steady], paths_for([predicted, steady])[0])
    (out / "trace.json").write_text(json.dumps(chrome))
    (out / "comparison.json").write_text(json.dumps(cmp.to_dict(), indent=1, default=str))


def run(args: argparse.Namespace) -> int:
    if args.schedule_only:
        return schedule_picture(Path(args.out))
    from costmodel.fitting.calibrate import calibrate_local
    from traces.analysis.compare import compare
    from traces.analysis.matching import drop_warmup_step
    from traces.trace import Trace
    from traces.analysis.whatif import whatif

    from pipeline.launch.run_args import variant_dir, with_residual_flag
    from configs import load_config

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(args.config, {"train": {"steps": args.steps, "device": "cpu"}})
    if args.residual:
        cfg = with_residual_flag(cfg, "--residual", args.residual)
    if cfg.model.residual.variant == "residual" or cfg.model.residual.n == 1:
        raise ValueError(f"the demo measures a residual against the plain one; {cfg.model.residual.label} is the plain "
                         "residual: name another with --residual, e.g. mhc:4")
    n = cfg.model.residual.n
    ranks = cfg.parallel.ranks
    timings: dict[str, float] = {}
    started = t = time.perf_counter()

    _say("1/5", "calibrating the `local` hardware spec (matmul, copy, launch, 2-process gloo P2P)")
    hw = calibrate_local(quick=True)
    print(f"      matmul {hw.peak_flops['fp32'] / 1e9:.1f} GFLOP/s, copy {hw.hbm_bandwidth / 1e9:.1f} GB/s, "
          f"P2P {hw.intra.latency_us:.0f} us + {hw.intra.bandwidth / 1e9:.2f} GB/s", flush=True)
    timings["calibration"] = time.perf_counter() - t
    t = time.perf_counter()
    base_cfg = cfg.with_residual("residual", 1)
    mhc_res, base_res = cfg.model.residual.label, base_cfg.model.residual.label
    _say("2/5", f"running mHC (n={n}) and the baseline (n=1) on {ranks} gloo ranks, one step of each in turn, "
                f"{args.steps} steps each")
    lines = run_torchrun(args.config, mhc_res, base_res, args.steps, out / "measured", args.timeout, ranks)
    base_trace = Trace.load(variant_dir(out / "measured", base_cfg) / "trace.json")
    base_meas = drop_warmup_step(base_trace)  # compared without the warm-up step; the fit skips it itself
    mhc_meas = drop_warmup_step(Trace.load(variant_dir(out / "measured", cfg) / "trace.json"))
    timings["baseline and mHC runs"] = time.perf_counter() - t
    t = time.perf_counter()
    _say("3/5", f"micro-benchmarking one stage of the runtime with and without mHC, measuring how 1..{ranks} ranks "
                f"share the cores and the OS time slice, fitting on the baseline trace, predicting baseline and "
                f"mHC (n={n})")
    hw, pred = predict_on_this_host(cfg, hw, base_trace, args.quick)
    # the prediction is stated once, at the end, as the comparison reads it (the summary's step adds the exposed
    # all-reduce and rounds differently: two numbers for one prediction confused readers)
    timings["prediction"] = time.perf_counter() - t
    t = time.perf_counter()
    _say("4/5", "comparing predicted with measured")
    pred.baseline.trace.save(out / "predicted_baseline.json")
    pred.mhc.trace.save(out / "predicted_mhc.json")
    base_cmp = compare(pred.baseline.trace, base_meas)
    mhc_cmp = compare(pred.mhc.trace, mhc_meas, baseline=(pred.baseline.trace, base_meas))
    _say("5/5", "writing the report and pictures")
    draw(out, cfg, pred.mhc.trace, mhc_meas, mhc_cmp)
    whatif_mhc0 = whatif(mhc_meas, {"mhc": 0.0}, baseline=base_meas, baseline_name="the baseline run").to_dict()
    timings["compare and draw"] = time.perf_counter() - t
    measured_mem = {"baseline": measured_memory(lines, base_res), "mhc": measured_memory(lines, mhc_res)}
    report = write_report(out / "report.md", cfg, hw, pred, base_cmp, mhc_cmp, timings, measured_mem, whatif_mhc0)
    o = mhc_cmp.overhead
    print(f"demo done in {time.perf_counter() - started:.0f} s; report: {report}")
    print(f"  step time: baseline predicted {base_cmp.makespan_pred_us / 1e3:.1f} ms vs measured "
          f"{base_cmp.makespan_meas_us / 1e3:.1f} ms; mHC predicted {mhc_cmp.makespan_pred_us / 1e3:.1f} ms vs "
          f"measured {mhc_cmp.makespan_meas_us / 1e3:.1f} ms ({mhc_cmp.makespan_err_pct:+.1f}%)")
    print(f"  mHC overhead: predicted {o.pred_pct:.1f}% vs measured {o.meas_pct:.1f}% ({o.diff_pp:+.1f} pp); "
          f"pictures: {out / 'schedule.png'}, {out / 'overhead.png'}; Perfetto: {out / 'trace.json'}")
    return 0


def schedule_picture(out: Path) -> int:
    """DualPipe P=8, M=20 at DeepSeek's unit costs: the picture of the schedule itself."""
    from schedules import Durations, build, simulate
    from schedules.formulas import bubble_formula
    from traces.drawing.plot import plot_schedule

    d = Durations(F=1, I=1, W=1)
    schedule = build("dualpipe", 8, 20)
    result = simulate(schedule, d, time_unit="cost units")
    name, value = bubble_formula(schedule, d)
    idle = sorted(set(result.idle.values()))
    print(f"DualPipe P=8, M=20 (F=I=W=1, B=2, F&B=3): makespan {result.makespan:g}, idle {idle} per rank "
          f"(formula {name} = {value:g}), peak activations {max(result.peak_activations.values())} chunks")
    path = plot_schedule(result.trace, out / "schedule_dualpipe.png",
                         title=f"DualPipe P=8, M=20: makespan {result.makespan:g}, idle {idle[0]:g} per rank")
    print(f"wrote {path}")
    return 0
