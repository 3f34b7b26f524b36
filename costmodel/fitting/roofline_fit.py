"""RooflineFit: a hardware spec's efficiencies fitted to a measured baseline run's action times (costmodel.md §3;
the fitter behind `mhcpipe calibrate --from-trace`, used through costmodel.fitting.trace_fit.fit_trace).

The cost model prices the trace's actions from kernels whose times are a roofline of three efficiency curves
(matrix, vector, memory) plus a per-kernel launch gap (costmodel.physics.hardware). The fit scales those four - each
curve as a whole, its shape kept and its efficiencies capped at 1, and the launch gap - so that the priced
actions match the measured ones: it minimises the mean squared log error over the action keys ('F/s3',
'FB/s3+s4'; measured = median over the trace's spans of that key) plus a weak pull of every log-scale towards
0, so a scale the trace cannot see (e.g. the vector curve when every elementwise kernel is memory-bound) stays 1.
Coordinate descent with a golden-section search per scale, a few rounds.

The result is the spec renamed `<name>-fitted`, to save as a profile and pass to `mhcpipe predict --hardware
FILE.json`; its meta holds the scales (`fit_scales`).
"""
from __future__ import annotations

import math
import statistics

from costmodel.physics.hardware import Curve, HardwareSpec
from costmodel.pricing.pricer import Pricer
from costmodel.pricing.stage_split import resolve_layout
from costmodel.pricing.options import Options
from costmodel.answers.predict import residual_spec_of
from costmodel.fitting.trace_fit import TraceFit, measured_action_us
from schedules.build import build
from schedules.ir import Action, Kind

SCALES = ("matrix", "vector", "memory", "launch")
LOG_BOUND = math.log(20.0)  # a scale between 1/20 and 20: beyond that the trace is not of this config
PULL = 1e-3  # weight of log(scale)^2 against the mean squared log error
ROUNDS = 4  # each round searches a third of the previous width: the last one, +-0.11 in log scale, to 7e-4


class RooflineFit:
    """costmodel.fitting.trace_fit.TraceFitter that scales `hw`'s efficiency curves and launch gap (module
    docstring)."""

    def fit(self, trace, cfg, hw: HardwareSpec) -> TraceFit:
        cfg = cfg.with_residual("residual", 1)  # the trace is a baseline run, whatever residual the config names
        measured = measured_action_us(trace)
        keys = sorted(measured)

        def loss(x: list[float]) -> float:
            hw_x = scaled_hardware(hw, *(math.exp(v) for v in x))
            priced = priced_action_us(cfg, hw_x, keys)
            err = statistics.fmean(math.log(priced[k] / measured[k]) ** 2 for k in keys)
            return err + PULL * sum(v * v for v in x)

        x = [0.0] * len(SCALES)
        best = loss(x)
        width = LOG_BOUND
        for _ in range(ROUNDS):
            for i in range(len(SCALES)):
                lo, hi = max(-LOG_BOUND, x[i] - width), min(LOG_BOUND, x[i] + width)
                x[i], best = _golden(lambda v, i=i: loss(x[:i] + [v] + x[i + 1:]), lo, hi, x[i], best)
            width /= 3
        scales = dict(zip(SCALES, (math.exp(v) for v in x)))
        fitted = scaled_hardware(hw, **scales)
        fitted = fitted.model_copy(update={
            "runtime": None, "name": f"{hw.name}-fitted",
            "description": f"{hw.description or hw.name}, efficiencies fitted to a trace",
            "meta": {**hw.meta, "fitted_from": trace.meta.get("source", "trace"), "fit_scales": scales,
                     "fit_base": hw.name, "fit_actions": len(keys)}})
        return TraceFit(fitted, measured, priced_action_us(cfg, hw, keys), priced_action_us(cfg, fitted, keys))


def scaled_hardware(hw: HardwareSpec, matrix: float = 1.0, vector: float = 1.0, memory: float = 1.0,
                    launch: float = 1.0) -> HardwareSpec:
    """`hw` with its efficiency curves multiplied by the given factors (capped at 1) and its launch gaps scaled."""
    def curve(c: Curve, f: float) -> Curve:
        return Curve(unit=c.unit, points=[(s, min(1.0, e * f)) for s, e in c.points])

    return hw.model_copy(update={
        "matrix_eff": curve(hw.matrix_eff, matrix), "vector_eff": curve(hw.vector_eff, vector),
        "memory_eff": curve(hw.memory_eff, memory), "launch_us": hw.launch_us * launch,
        "bwd_launch_us": None if hw.bwd_launch_us is None else hw.bwd_launch_us * launch})


def _action_of(key: str) -> Action:
    head, _, partner = key.partition("+")
    kind, stage = head.split("/s")
    if partner:
        return Action(Kind.FB, int(stage), 0, int(partner.removeprefix("s")), 0)
    return Action(Kind(kind), int(stage), 0)


def priced_action_us(cfg, hw: HardwareSpec, keys, spec=None) -> dict[str, float]:
    """The cost model's time of every action key for `cfg` on `hw` (roofline pricing, no runtime profile)."""
    p = cfg.parallel
    layout = resolve_layout(cfg, build(p.schedule, p.ranks, p.microbatches_per_replica), allow_uneven=True)
    pricer = Pricer(cfg, hw.model_copy(update={"runtime": None}), spec or residual_spec_of(cfg), layout, Options())
    out = {}
    for key in keys:
        action = _action_of(key)
        stages = [action.stage] + ([action.b_stage] if action.b_stage >= 0 else [])
        missing = [s for s in stages if s not in layout]
        if missing:
            raise ValueError(f"trace action {key} has stage {missing[0]}, but {cfg.model.name} on "
                             f"{p.schedule} x {p.ranks} ranks has stages 0..{max(layout)}: give the config of the "
                             "traced run (--preset/--config with its layout)")
        out[key] = pricer.compute_time(action)
    return out


def at_bound(scales: dict[str, float]) -> list[str]:
    """Scales the fit pushed to a bound: the spec is far from the traced machine there (or the trace from the
    config), and the fitted value is only a limit."""
    return [k for k, v in scales.items() if abs(abs(math.log(v)) - LOG_BOUND) < 1e-3]


def _golden(f, lo: float, hi: float, x0: float, f0: float, iters: int = 12) -> tuple[float, float]:
    """Minimum of f on [lo, hi] (golden-section search), never worse than the starting point (x0, f0). 12 steps
    shrink the interval 320-fold: finer than any round but the last needs, since the next round re-searches."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    x, fx = (c, fc) if fc < fd else (d, fd)
    return (x, fx) if fx < f0 else (x0, f0)
