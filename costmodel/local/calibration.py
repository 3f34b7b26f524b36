"""Calibration of `local` for this runtime and one config (costmodel.md §3): calibrate_local_for(cfg, ...) ->
the host's HardwareSpec `local` with a RuntimeProfile (costmodel.physics.runtime_profile) for cfg's shape.

Its inputs, measured by the caller with the runtime's own code (pipeline.launch.host_measurements; the app layer
connects the two, so the cost model never imports the runtime):
  1. stage timings: a one-block middle stage through the runtime's Stage code, F, I, W and B, with the plain
     residual and with each priced residual (their difference is the residual's extra cost per sub-layer),
     plus the recompute rebuild and the stack ends (time_stage_pieces);
  2. a measured BASELINE (n = 1) run of the config on its local ranks (never an mHC run: an mHC trace is
     refused);
  3. the workload whose concurrent rounds measure how the ranks share the cores (block_round).
Measured here: the host micro-benchmarks (costmodel.fitting.calibrate.calibrate_local, unless a spec is given),
cores(k) for k = 1 .. ranks, the OS time slice among `ranks` busy processes and the protection after a wake-up
(core_sharing.py). Fitted by runtime_fit.RuntimeProfileFit through costmodel.fitting.trace_fit.fit_trace: full-speed
work per action, executor gap, effective P2P latency, the residual's extra per kind.
predict(..., profile_pricing=HostPricing()) then prices a baseline action as its fitted work (replay) and an
mHC action as that plus sub-layers x the micro-benchmarked extra cost of its kind, and simulates them on ranks
sharing the host's cores (host_pricing.py, shared_cores.py).
"""
from __future__ import annotations

from typing import Callable

from costmodel.fitting.calibrate import calibrate_local
from costmodel.physics.hardware import HardwareSpec, get_hardware
from costmodel.local.core_sharing import measure_core_sharing, measure_protection, measure_time_slice
from costmodel.local.runtime_fit import RuntimeProfileFit
from costmodel.fitting.trace_fit import fit_trace


def calibrate_local_for(cfg, *, baseline_trace, stage_us: dict, workload: Callable[[dict], Callable[[], None]],
                        hardware=None, quick: bool = True, cores: list[float] | None = None,
                        time_slice_us: float | None = None, protect_us: float | None = None) -> HardwareSpec:
    """`local` HardwareSpec for `cfg` (see the module docstring): `baseline_trace` a measured baseline run of
    cfg, `stage_us` the runtime's stage timings for the residuals to price, `workload` the core-sharing round;
    `hardware` the host spec (calibrate_local(quick) when None); cores(k), the time slice and the protection
    are measured unless given."""
    hw = hardware if isinstance(hardware, HardwareSpec) else (
        get_hardware(hardware) if hardware is not None else calibrate_local(quick=quick))
    hw = hw.model_copy(update={"runtime": None})
    if cores is None:
        cores = measure_core_sharing(cfg, cfg.parallel.ranks, workload, cycles=12 if quick else 24)
    if time_slice_us is None:
        time_slice_us = measure_time_slice(cfg.parallel.ranks)
    if protect_us is None:
        protect_us = measure_protection(cfg.parallel.ranks, time_slice_us)
    fitter = RuntimeProfileFit(stage_us, cores, time_slice_us=time_slice_us, protect_us=protect_us)
    return fit_trace(baseline_trace, cfg, hw, fitter).hardware
