"""Calibration of this runtime on `local` for one config: micro-benchmarks plus a baseline run (costmodel.md §3).

calibrate_local_for(cfg) -> HardwareSpec `local` with a RuntimeProfile (hardware.py) for cfg's shape:
  1. micro-benchmarks in this process (runtime_bench.py, 1 thread like a rank): a one-block middle stage through
     the runtime's own Stage code, F, I, W and B, with the plain residual and with each priced residual (their
     difference is the residual's extra cost per sub-layer), plus the recompute rebuild and the stack ends.
  2. cores(k): how k concurrent single-thread ranks share this host (core_sharing.py), k = 1 .. ranks, and the
     OS time slice among `ranks` busy processes.
  3. one measured BASELINE (n = 1) run of the config on its local gloo ranks (never an mHC run: an mHC trace is
     refused), fitted by runtime_fit: full-speed work per action, executor gap, effective P2P latency.
predict() then prices a baseline action as its fitted work (replay) and an mHC action as that plus sub-layers x
the micro-benchmarked extra cost of its kind, and simulates them on ranks sharing the host's cores (shared_cores.py).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from costmodel.calibrate import calibrate_local
from costmodel.runtime_bench import bench_runtime_pieces


def runtime_key(cfg) -> dict:
    """What the per-action costs depend on: model shape, tokens per micro-batch, layout, recompute, dtype."""
    m, p = cfg.model, cfg.parallel
    return {"model": {"vocab_size": m.vocab_size, "num_blocks": m.num_blocks, "hidden": m.hidden,
                      "num_heads": m.num_heads, "head_dim": m.head_dim, "mlp_hidden": m.mlp_hidden,
                      "moe": None if m.moe is None else m.moe.model_dump()},
            "tokens_per_microbatch": p.tokens_per_microbatch, "seq_len": p.seq_len, "schedule": p.schedule,
            "ranks": p.ranks, "recompute": cfg.recompute.model_dump(), "dtype": cfg.train.dtype}


def run_runtime_interleaved(cfgs: list, trace_dirs: list[str | Path], steps: int | None = None,
                            timeout_s: float = 300.0):
    """Run several configs in one launch on their local gloo ranks, one step of each in turn
    (pipeline.local.interleaved_worker): an A/B measurement in which every variant sees the same drift of a
    shared host's speed. Returns [(Trace, per-step step times in seconds)], one per config."""
    from pipeline.local import interleaved_worker, launch
    from traces.trace import Trace

    data = []
    for cfg in cfgs:
        d = cfg.model_dump()
        if steps is not None:
            d["train"]["steps"] = steps
        d["train"]["device"] = "cpu"
        data.append(d)
    dirs = [Path(t) for t in trace_dirs]
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    res = launch(interleaved_worker, cfgs[0].parallel.ranks, (data, [str(d) for d in dirs]), timeout_s=timeout_s)
    bad = [r for r in res if r.exitcode != 0]
    if bad:
        raise RuntimeError(f"runtime run failed: {bad[0].error or f'rank {bad[0].rank} exit {bad[0].exitcode}'}")
    return [(Trace.load(d / "trace.json"), [s["step_time_s"] for s in stats]) for d, stats in zip(dirs, res[0].value)]


def run_runtime(cfg, trace_dir: str | Path, steps: int | None = None, timeout_s: float = 300.0):
    """Run cfg on its local gloo ranks and load the measured trace (run_runtime_interleaved with one config).
    Returns (Trace, per-step step times in seconds as the runtime reports them)."""
    return run_runtime_interleaved([cfg], [trace_dir], steps, timeout_s)[0]


def calibrate_local_for(cfg, *, hardware=None, baseline_trace=None, steps: int = 4, variants=None,
                        rounds: int = 40, work_dir: str | Path | None = None, quick: bool = True,
                        timeout_s: float = 300.0, cores: list[float] | None = None,
                        time_slice_us: float | None = None, protect_us: float | None = None):
    """`local` HardwareSpec for `cfg`: host micro-benchmarks (calibrate_local unless `hardware` is given), the
    runtime micro-benchmarks, cores(k) for k up to the config's ranks, the OS time slice among that many busy
    processes and the protection after a wake-up (each measured unless given), and a measured BASELINE run of
    cfg (run here unless `baseline_trace` is given), fitted by runtime_fit. variants: [(variant, n)] residuals to
    price (default: cfg's own)."""
    from costmodel.core_sharing import measure_core_sharing, measure_protection, measure_time_slice
    from costmodel.hardware import HardwareSpec, get_hardware
    from costmodel.runtime_fit import fit_runtime_profile

    hw = hardware if isinstance(hardware, HardwareSpec) else (
        get_hardware(hardware) if hardware is not None else calibrate_local(quick=quick))
    hw = hw.model_copy(update={"runtime": None})
    r = cfg.model.residual
    variants = list(variants) if variants is not None else [(r.variant, r.n)]
    base_cfg = cfg.with_residual("residual", 1)
    bench = bench_runtime_pieces(cfg, variants, rounds=rounds)
    if cores is None:
        cores = measure_core_sharing(cfg, cfg.parallel.ranks, cycles=12 if quick else 24)
    if time_slice_us is None:
        time_slice_us = measure_time_slice(cfg.parallel.ranks)
    if protect_us is None:
        protect_us = measure_protection(cfg.parallel.ranks, time_slice_us)
    if baseline_trace is None:
        tmp = tempfile.mkdtemp(prefix="cal_base_") if work_dir is None else str(work_dir)
        baseline_trace, _ = run_runtime(base_cfg, tmp, steps, timeout_s)
    profile = fit_runtime_profile(baseline_trace, cfg, bench, cores, hw, time_slice_us=time_slice_us,
                                  protect_us=protect_us)
    return hw.model_copy(update={"runtime": profile})
