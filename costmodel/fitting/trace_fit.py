"""Fitting a hardware spec to a measured trace: the one entry point, `fit_trace(trace, cfg, hw, fitter)`.

The trace is a run of this runtime (`mhcpipe run --trace-dir`, bench/stage_bench.py, or the demo's runs) holding every
F, I, W, B and F&B action, named as in traces.md §5. It must be a BASELINE (n = 1) run of `cfg`'s model and
layout: the mHC run is what the fitted spec then predicts, never an input (costmodel.md §3). A fitter turns the
measured action times into a fitted spec:
* costmodel.fitting.roofline_fit.RooflineFit scales a spec's efficiency curves and launch gap (any hardware,
  `mhcpipe calibrate --from-trace`);
* costmodel.local.runtime_fit.RuntimeProfileFit fits a runtime profile for `local` (full-speed work per
  action on ranks sharing the host's cores), from the host measurements it is built with.
Both read the trace with the helpers here: action keys 'F/s3' and 'FB/s3+s4', F/B halves inside an F&B left out.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Protocol

from costmodel.physics.hardware import HardwareSpec
from traces.analysis.stage_chains import schedule_descriptor

RUNTIME_KINDS = ("F", "I", "W", "B", "FB")


@dataclass
class TraceFit:
    """What a fit returns: the fitted spec and, per action key, the measured time it was fitted to; where the
    fitter prices the keys itself, also their prices with the input spec and with the fitted one."""

    hardware: HardwareSpec
    measured_us: dict[str, float]
    before_us: dict[str, float] | None = None
    after_us: dict[str, float] | None = None

    def kind_errors(self) -> dict[str, tuple[float, float]]:
        """Per kind, median |error| in % before and after the fit (empty when the fitter priced no keys)."""
        if self.before_us is None or self.after_us is None:
            return {}
        out: dict[str, tuple[float, float]] = {}
        for kind in sorted({k.split("/")[0] for k in self.measured_us}):
            keys = [k for k in self.measured_us if k.split("/")[0] == kind]
            err = [statistics.median(abs(p[k] / self.measured_us[k] - 1) * 100 for k in keys)
                   for p in (self.before_us, self.after_us)]
            out[kind] = (err[0], err[1])
        return out


class TraceFitter(Protocol):
    def fit(self, trace, cfg, hw: HardwareSpec) -> TraceFit:
        """`hw` fitted to `trace`, a checked baseline run of `cfg`'s model and layout."""


def fit_trace(trace, cfg, hw: HardwareSpec, fitter: TraceFitter) -> TraceFit:
    """Fit `hw` to `trace` with `fitter` after refusing a trace that is not a baseline run of `cfg`'s model and
    layout (see the module docstring)."""
    check_baseline_trace(trace)
    check_same_run(trace, cfg)
    return fitter.fit(trace, cfg, hw)


def action_key(s) -> str:
    return f"{s.kind}/s{s.stage}" + (f"+s{s.partner[0]}" if s.kind == "FB" and s.partner else "")


def nested_in_fb(spans) -> set[int]:
    """Indices of F/B spans that are the halves of an overlapped FB (inside an FB span on the same rank)."""
    fbs: dict[int, list] = {}
    for s in spans:
        if s.kind == "FB":
            fbs.setdefault(s.rank, []).append((s.start, s.end))
    out = set()
    for i, s in enumerate(spans):
        if s.kind in ("F", "B"):
            for a, b in fbs.get(s.rank, ()):
                if a - 1e-6 <= s.start and s.end <= b + 1e-6:
                    out.add(i)
                    break
    return out


def measured_action_us(trace) -> dict[str, float]:
    """Per action key, the median duration of the trace's compute actions (F/B halves inside an F&B excluded)."""
    spans = [s for s in trace.spans if s.kind in RUNTIME_KINDS and s.stage is not None]
    halves = nested_in_fb(spans)
    by_key: dict[str, list[float]] = {}
    for i, s in enumerate(spans):
        if i not in halves and s.duration > 0:
            by_key.setdefault(action_key(s), []).append(s.duration)
    if not by_key:
        raise ValueError("the trace has no F/I/W/B/FB action spans with a stage (named as in traces.md §5, e.g. "
                         "F/s3/mb7); record the run with `mhcpipe run --trace-dir` or bench/stage_bench.py")
    return {k: statistics.median(v) for k, v in by_key.items()}


def check_baseline_trace(trace) -> None:
    res = trace.meta.get("residual")
    if isinstance(res, dict):
        variant, n = res.get("variant"), res.get("n")
        if variant not in (None, "residual") or n not in (None, 1):
            raise ValueError(f"calibration needs a baseline (n = 1, plain residual) run, got a trace of "
                             f"{variant} n={n}: the mHC run is the test, never an input (costmodel.md §3)")


def check_same_run(trace, cfg) -> None:
    """Refuse a trace of another model or layout than `cfg` (its meta, when the recorder wrote it)."""
    meta = trace.meta
    model = meta.get("model")
    if isinstance(model, str) and model != cfg.model.name:
        raise ValueError(f"the trace is of model {model!r}, the config of {cfg.model.name!r}: give the traced run's "
                         "config (--preset/--config)")
    # one replica's pipeline, as the runtime and the cost model record it
    want = {"kind": cfg.parallel.schedule, "ranks": cfg.parallel.ranks,
            "microbatches": cfg.parallel.microbatches_per_replica}
    have = schedule_descriptor(meta)
    diffs = [f"{k} {have[k]!r} vs {want[k]!r}" for k in want if k in have and str(have[k]).lower() != str(want[k])]
    if diffs:
        raise ValueError(f"the trace and the config differ in parallel layout (trace vs config: {'; '.join(diffs)}); "
                         "give the traced run's config")
