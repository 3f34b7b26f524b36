"""`mhcpipe predict --sensitivity [X]`: how far mHC's predicted overhead moves when one input moves, the others
held: a one-at-a-time range per input (a tornado), sorted by swing.

Shape letters: C hidden, M micro-batches, EP expert-parallel degree, E routed experts.

Inputs and how each moves (X = the percentage, default 20):
* HBM bandwidth, inter-node and intra-node link bandwidth: the hardware spec's value times (1 -+ X/100).
  They are datasheet peaks times efficiencies nobody has measured on the target yet (hardware.py).
* GEMM efficiency: the matrix efficiency curve scaled by (1 -+ X/100), capped at 1 (a curve cannot exceed peak).
* mHC kernel bandwidth: the efficiency curve of the mHC kernels' HBM traffic (HardwareSpec.mhc_memory_eff, the
  memory curve where the spec has none; pricing applies it to the kernel groups "mhc" and "recompute") scaled
  the same way, capped at 1; everything else keeps the memory curve. TileLang, Triton and cuTile kernels of the
  same math differ by up to ~2x (mhc.md §8: kainzhong/mhc_bench, Megatron-LM PR #3828), so this is measured, not
  a choice. The plain residual's adds and norm rebuild are in those groups too (mhc_cost.py), so the baseline
  moves with it, by its far smaller residual traffic.
* EP: integer, moves to the next lower and higher power of two that divides E (DeepEP-style groups are powers of
  two; the config requires EP | E); a side with no such value is left out.
* M: integer, moves to the nearest lower and higher micro-batch count the schedule accepts (the generator owns
  the M/P rules, e.g. DualPipe's even M).
* C: the hidden size times (1 -+ X/100), rounded to an integer; everything else in the model is held.
* The model's own constants (ASSUMED), each with its source: the HBM efficiency curve (its Hopper ceiling is the
  H200-measured copy, read across), the SM share a memory-bound kernel needs, the kernel launch gap, the
  all-to-all's SM carve-out and the InfiniBand efficiency and latency move -+X% (capped where a share tops at 1,
  integers rounded), and so do the NVLink efficiency and latency, the attention backward factor, the Sinkhorn
  iterations t_max (integer) and the
  memory reserve's terms (CUDA context, NCCL and DeepEP buffers, fragmentation: they move memory, not time);
  sigma and the mHC kernels' efficiency are choices between two sourced readings, so they move
  to the other reading (SIGMA_ALT, CUTILE_MHC_EFF of explain.py) only. The caller's --sigma and --comm-sms become
  the spec's values first, so their rows move what prices them.
Hardware inputs are uncertainties to measure; EP, M and C are layout choices, reported apart.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import pydantic

from costmodel.physics.hardware import Curve, HardwareSpec
from costmodel.physics.mhc_cost import ResidualSpec
from costmodel.answers.predict import predict
from costmodel.pricing.pricer import ProfilePricing
from costmodel.pricing.options import Options
from configs import RunConfig

DEFAULT_PCT = 20.0
MEASURED = ("HBM bandwidth TB/s", "inter-node bandwidth GB/s", "intra-node bandwidth GB/s", "GEMM efficiency",
            "mHC kernel bandwidth", "FP8 GEMM efficiency", "attention forward efficiency",
            "attention backward efficiency")  # the last three from published kernel benchmarks (hardware.py)
CHOICES = ("EP", "M (micro-batches)", "C (hidden)")
ASSUMED = ("HBM efficiency", "SM share of HBM-bound kernels", "kernel launch gap us", "all-to-all SMs",
           "IB efficiency", "IB latency us", "NVLink efficiency", "NVLink latency us", "Sinkhorn iterations",
           "attention backward factor",
           "CUDA context GiB", "NCCL buffers GiB", "DeepEP buffers GB", "fragmentation share",
           "sigma (compute under A2A)", "mHC kernels at cuTile")


@dataclass
class Point:
    label: str
    step_pct: float
    fb_pct: float | None
    memory_gib: float | None = None  # mHC's peak memory per GPU (the busiest rank)


@dataclass
class Row:
    name: str
    note: str
    low: Point | None = None
    high: Point | None = None

    def values(self, metric: str, base: Point) -> list[float]:
        pts = [base] + [p for p in (self.low, self.high) if p is not None]
        vals = [getattr(p, metric) for p in pts]
        return [v for v in vals if v is not None]

    def swing(self, metric: str, base: Point) -> float:
        v = self.values(metric, base)
        return max(v) - min(v) if v else 0.0


@dataclass
class Sensitivity:
    config: str
    hardware: str
    pct: float
    base: Point
    metric: str  # what the rows are sorted by: "fb_pct" (the like-for-like number) or "step_pct"
    rows: list[Row] = field(default_factory=list)

    def measure_first(self) -> Row | None:
        return next((r for r in self.rows if r.name in MEASURED), None)

    def top_choice(self) -> Row | None:
        return next((r for r in self.rows if r.name in CHOICES), None)

    def top_assumption(self) -> Row | None:
        return next((r for r in self.rows if r.name in ASSUMED), None)


def check_pct(pct: float) -> float:
    if not (pct == pct and 0 < pct < 100):  # pct == pct: NaN is neither
        raise ValueError(f"--sensitivity {pct:g}: give the move in percent, greater than 0 and below 100 (e.g. 20)")
    return float(pct)


def _cfg_with(cfg: RunConfig, section: str, **fields) -> RunConfig | None:
    """The config with `fields` of `section` replaced, or None when the config rules reject it."""
    data = cfg.model_dump()
    data[section].update(fields)
    try:
        return RunConfig.model_validate(data)
    except (pydantic.ValidationError, ValueError):
        return None


def _ep_moves(cfg: RunConfig) -> tuple[int | None, int | None]:
    moe = cfg.model.moe
    if moe is None:
        return None, None
    ep, E = cfg.parallel.expert_parallel, moe.num_experts
    pows = [1 << i for i in range(E.bit_length()) if E % (1 << i) == 0 and _cfg_with(cfg, "parallel",
                                                                                    expert_parallel=1 << i)]
    lower = [p for p in pows if p < ep]
    higher = [p for p in pows if p > ep]
    return (lower[-1] if lower else None), (higher[0] if higher else None)


def _m_moves(cfg: RunConfig) -> tuple[int | None, int | None]:
    M = cfg.parallel.microbatches
    lower = next((m for m in range(M - 1, 0, -1) if _cfg_with(cfg, "parallel", microbatches=m)), None)
    higher = next((m for m in range(M + 1, 4 * M + 2) if _cfg_with(cfg, "parallel", microbatches=m)), None)
    return lower, higher


def moves(cfg: RunConfig, hw: HardwareSpec,
          pct: float) -> list[tuple[str, str, list[tuple[str, RunConfig, HardwareSpec]]]]:
    """Per input: (name, note, [low side, high side]), a side (value label, config, hardware) or None where the
    input has no valid value on that side."""
    f = pct / 100.0
    out = []

    def scaled(name: str, unit: str, value: float, make) -> None:
        sides = [(f"{value * k / unit:.4g}", cfg, make(value * k)) for k in (1 - f, 1 + f)]
        out.append((name, f"{value / unit:.4g} -+{pct:g}%", sides))

    GB = 1e9
    scaled("HBM bandwidth TB/s", 1e12, hw.hbm_bandwidth, lambda v: hw.model_copy(update={"hbm_bandwidth": v}))
    scaled("inter-node bandwidth GB/s", GB, hw.inter.bandwidth,
           lambda v: hw.model_copy(update={"inter": hw.inter.with_bandwidth(v)}))
    scaled("intra-node bandwidth GB/s", GB, hw.intra.bandwidth,
           lambda v: hw.model_copy(update={"intra": hw.intra.with_bandwidth(v)}))

    def curve(name: str, field: str, c: Curve, note: str) -> None:
        """The curve `c` scaled so its top moves by -+pct, capped at 1, set as the spec's `field`."""
        top = max(e for _, e in c.points)
        sides = []
        for k in (1 - f, 1 + f):
            t = min(1.0, top * k)
            sides.append((f"{t:.3g}", cfg, hw.model_copy(update={field: c.scaled(t)})))
        out.append((name, f"curve top {top:.3g} -+{pct:g}%" + (", capped at 1" if top * (1 + f) > 1 else "") + note,
                    sides))

    curve("GEMM efficiency", "matrix_eff", hw.matrix_eff,
          " (Hopper: the H200-measured 0.80 ceiling, gpu.md §3, read across to H100/H800)")
    if cfg.train.fp8:
        curve("FP8 GEMM efficiency", "fp8_matrix_eff", hw.matrix_curve("fp8"),
              " (Hopper: DeepGEMM's best V3 training shape on H800, hardware.py)")
    curve("attention forward efficiency", "attention_fwd_eff", hw.matrix_curve(op="attn_fwd"),
          " (Hopper: FlashAttention-3, head dim 128, 4k, hardware.py)")
    curve("attention backward efficiency", "attention_bwd_eff", hw.matrix_curve(op="attn_bwd"),
          " (Hopper: FlashAttention-3, head dim 128, 4k, hardware.py)")
    curve("HBM efficiency", "memory_eff", hw.memory_eff,
          " (Hopper: the H200-measured copy 0.896 ceiling read across; every memory-bound kernel"
          + (", the mHC kernels included)" if hw.mhc_memory_eff is None else ")"))
    mhc = hw.memory_eff if hw.mhc_memory_eff is None else hw.mhc_memory_eff
    curve("mHC kernel bandwidth", "mhc_memory_eff", mhc,
          f" ({'memory curve' if hw.mhc_memory_eff is None else 'mhc_memory_eff'} of the groups mhc+recompute; "
          "TileLang/Triton/cuTile kernels differ by up to ~2x)")
    assumed(out, cfg, hw, f, pct)
    lo, hi = _ep_moves(cfg)
    if lo or hi:
        sides = [(f"EP {v}", _cfg_with(cfg, "parallel", expert_parallel=v), hw) if v else None for v in (lo, hi)]
        out.append(("EP", f"{cfg.parallel.expert_parallel}: next powers of two dividing "
                           f"{cfg.model.moe.num_experts} experts (integer)", sides))
    lo, hi = _m_moves(cfg)
    if lo or hi:
        sides = [(f"M {v}", _cfg_with(cfg, "parallel", microbatches=v), hw) if v else None for v in (lo, hi)]
        out.append(("M (micro-batches)", f"{cfg.parallel.microbatches}: neighbouring counts the "
                    f"{cfg.parallel.schedule} schedule accepts (integer)", sides))
    C = cfg.model.hidden
    sides = []
    for k in (1 - f, 1 + f):
        c = max(1, round(C * k))
        sides.append((f"C {c}", _cfg_with(cfg, "model", hidden=c), hw))
    out.append(("C (hidden)", f"{C} -+{pct:g}%, rounded", [s if s[1] is not None else None for s in sides]))
    return out


def assumed(out: list, cfg: RunConfig, hw: HardwareSpec, f: float, pct: float) -> None:
    """The model's own constants, each moved with its source (hardware.py, explain.py): -+pct where the constant is
    a scale, its sourced alternative where it is a choice between two readings."""

    def scaled(name: str, value: float, make, source: str, cap: float | None = None, integer: bool = False) -> None:
        sides = []
        for k in (1 - f, 1 + f):
            v = value * k
            v = round(v) if integer else v
            v = min(cap, v) if cap is not None else v
            sides.append((f"{v:.4g}", cfg, make(v)) if v != value else None)
        out.append((name, f"{value:.4g} -+{pct:g}%{', capped at %g' % cap if cap and value * (1 + f) > cap else ''}"
                    f" ({source})", sides))

    scaled("SM share of HBM-bound kernels", hw.bandwidth_sm_share,
           lambda v: hw.model_copy(update={"bandwidth_sm_share": v}),
           "assumed: a third of Hopper's SMs saturate HBM", cap=1.0)
    scaled("kernel launch gap us", hw.launch_us,
           lambda v: hw.model_copy(update={"launch_us": v, "bwd_launch_us": None if hw.bwd_launch_us is None
                                           else hw.bwd_launch_us * v / hw.launch_us}),
           "assumed: back-to-back CUDA kernels without graphs")
    if hw.comm_sms:
        scaled("all-to-all SMs", hw.comm_sms, lambda v: hw.model_copy(update={"comm_sms": int(v)}),
               "DeepSeek-V3 §3.2.2: 20 of 132 SMs; DeepEP's default", integer=True)
    for name, link, field_, source, cap in (
            ("IB efficiency", "inter", "efficiency", "Calculon's InfiniBand 0.9", 1.0),
            ("IB latency us", "inter", "latency_us", "Calculon's 2 us", None),
            ("NVLink efficiency", "intra", "efficiency", "Calculon's 0.6; H800 0.8, DeepSeek-V3's 160 of 200 GB/s",
             1.0),
            ("NVLink latency us", "intra", "latency_us", "Calculon's 1 us", None)):
        ln = getattr(hw, link)
        scaled(name, getattr(ln, field_),
               lambda v, link=link, ln=ln, f=field_: hw.model_copy(update={link: ln.model_copy(update={f: v})}),
               source, cap=cap)
    scaled("attention backward factor", hw.attention_bwd_factor,
           lambda v: hw.model_copy(update={"attention_bwd_factor": v}),
           "FlashAttention-2: five matmuls against two")
    t = cfg.model.residual.sinkhorn_iters
    sides = []
    for k in (1 - f, 1 + f):
        v = max(1, round(t * k))
        res = cfg.model.residual.model_copy(update={"sinkhorn_iters": v})
        c = cfg.model_copy(update={"model": cfg.model.model_copy(update={"residual": res})})
        sides.append((f"{v}", c, hw) if v != t else None)
    out.append(("Sinkhorn iterations", f"{t} -+{pct:g}%, rounded (mHC, V4: t_max = 20)", sides))
    r = hw.reserve
    for name, term, unit, source in (
            ("CUDA context GiB", "cuda_context_bytes", 2**30, "assumed 0.75 GiB: ~0.7 GiB seen per process"),
            ("NCCL buffers GiB", "nccl_bytes", 2**30, "assumed 0.5 GiB for all communicators"),
            ("DeepEP buffers GB", "deepep_nvl_bytes", 1e9, "DeepEP V1 tests' 2e9 NVLink (+1e9 RDMA) buffers"),
            ("fragmentation share", "fragmentation", 1, "Megatron's 5% of the activations")):
        value = getattr(r, term)
        if name == "DeepEP buffers GB":  # both of DeepEP's buffers move together
            def make(v, value=value):
                k = v / value
                return hw.model_copy(update={"reserve": r.model_copy(update={
                    "deepep_nvl_bytes": r.deepep_nvl_bytes * k, "deepep_rdma_bytes": r.deepep_rdma_bytes * k})})
        else:
            def make(v, term=term):
                return hw.model_copy(update={"reserve": r.model_copy(update={term: v})})
        sides = [(f"{value * k / unit:.3g}", cfg, make(value * k)) for k in (1 - f, 1 + f)]
        out.append((name, f"{value / unit:.3g} -+{pct:g}% ({source}; memory only)", sides))
    from costmodel.answers.honest import CUTILE_MHC_EFF, SIGMA_ALT  # the honest answer's two readings

    if hw.interference != SIGMA_ALT:
        out.append(("sigma (compute under A2A)", f"{hw.interference:g} -> {SIGMA_ALT:g} (DeepSeek-V3 §3.2.2 "
                    "20/132 SMs, Calculon's NVLink processor_usage 0.15: the pessimistic reading)",
                    [None, (f"{SIGMA_ALT:g}", cfg, hw.model_copy(update={"interference": SIGMA_ALT}))]))
    top = max(e for _, e in CUTILE_MHC_EFF.points)
    out.append(("mHC kernels at cuTile", f"flat {top:g} of peak HBM (Megatron-LM PR #3828 on GB200, read across)",
                [None, (f"{top:g}", cfg, hw.model_copy(update={"mhc_memory_eff": CUTILE_MHC_EFF}))]))


def sensitivity(cfg: RunConfig, hw: HardwareSpec, spec: ResidualSpec, options: Options, pct: float = DEFAULT_PCT,
                profile_pricing: ProfilePricing | None = None) -> Sensitivity:
    pct = check_pct(pct)
    if spec.is_baseline:
        raise ValueError("--sensitivity: the residual is the plain baseline (n=1): there is no mHC overhead to vary; "
                         "use --variant mhc (or --n 4)")

    # the caller's --sigma / --comm-sms become the spec's, so that their rows move what prices them
    hw = hw.model_copy(update={k: v for k, v in (("interference", options.sigma), ("comm_sms", options.comm_sms))
                               if v is not None})
    options = dataclasses.replace(options, sigma=None, comm_sms=None)

    def point(label: str, c: RunConfig, h: HardwareSpec) -> Point:
        sp = dataclasses.replace(spec, sinkhorn_iters=c.model.residual.sinkhorn_iters)  # the Sinkhorn row's move
        s = predict(c, h, sp, options, ladder=False, profile_pricing=profile_pricing).summary
        return Point(label, s["step_overhead_pct"], s["fb_stage_overhead_pct"], s["memory_gib"]["mhc"])

    base = point("base", cfg, hw)
    metric = "fb_pct" if base.fb_pct is not None else "step_pct"
    rows = []
    for name, note, sides in moves(cfg, hw, pct):
        low, high = sides
        rows.append(Row(name, note, point(*low) if low else None, point(*high) if high else None))
    rows.sort(key=lambda r: -r.swing(metric, base))
    return Sensitivity(cfg.model.name, hw.name, pct, base, metric, rows)


# ---- output ------------------------------------------------------------------------------------------------
def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}%"


def format_sensitivity(se: Sensitivity) -> str:
    b = se.base
    what = "F&B stage" if se.metric == "fb_pct" else "step"
    lines = [f"mhcpipe predict --sensitivity {se.pct:g}: {se.config} on {se.hardware}",
             f"  mHC overhead at the base: {_pct(b.fb_pct)} of the overlapped F&B stage, {_pct(b.step_pct)} of the "
             f"step; one input moved at a time, rows sorted by the swing of the {what} overhead", "",
             f"  {'input':<27}{'low':>10}{'high':>10}{'F&B stage low..high':>24}{'swing':>9}"
             f"{'step low..high':>22}{'swing':>9}{'GiB low..high':>16}  moved"]
    for r in se.rows:
        lo = r.low.label if r.low else "-"
        hi = r.high.label if r.high else "-"
        fb = f"{_pct(r.low.fb_pct) if r.low else '-'} .. {_pct(r.high.fb_pct) if r.high else '-'}"
        st = f"{_pct(r.low.step_pct) if r.low else '-'} .. {_pct(r.high.step_pct) if r.high else '-'}"
        mem = (f"{f'{r.low.memory_gib:.1f}' if r.low else '-'} .. "
               f"{f'{r.high.memory_gib:.1f}' if r.high else '-'}")
        lines.append(f"  {r.name:<27}{lo:>10}{hi:>10}{fb:>24}{r.swing('fb_pct', b):>8.2f}p"
                     f"{st:>22}{r.swing('step_pct', b):>8.2f}p{mem:>16}  {r.note}")
    lines.append("")
    first, choice = se.measure_first(), se.top_choice()
    if first:
        lines.append(f"  measure this first: {first.name} "
                     f"(moves the {what} overhead by {first.swing(se.metric, b):.2f} "
                     f"pp over -+{se.pct:g}%)")
    assumption = se.top_assumption()
    if assumption:
        lines.append(f"  of the model's own constants, {assumption.name} moves it most "
                     f"({assumption.swing(se.metric, b):.2f} pp): {assumption.note}")
    if choice:
        lines.append(f"  of the layout choices, {choice.name} moves it most ({choice.swing(se.metric, b):.2f} pp)")
    heavy = max(se.rows, key=lambda r: r.swing("memory_gib", b), default=None)
    if heavy is not None and heavy.swing("memory_gib", b) > 0:
        lines.append(f"  memory per GPU ({b.memory_gib:.1f} GiB at the base) moves most with {heavy.name} "
                     f"({heavy.swing('memory_gib', b):.1f} GiB)")
    return "\n".join(lines)


def to_json(se: Sensitivity) -> dict[str, Any]:
    return {"config": se.config, "hardware": se.hardware, "pct": se.pct, "sorted_by": se.metric,
            "base": dataclasses.asdict(se.base),
            "rows": [{"input": r.name, "note": r.note,
                      "low": dataclasses.asdict(r.low) if r.low else None,
                      "high": dataclasses.asdict(r.high) if r.high else None,
                      "swing_fb_pp": r.swing("fb_pct", se.base), "swing_step_pp": r.swing("step_pct", se.base),
                      "swing_memory_gib": r.swing("memory_gib", se.base)}
                     for r in se.rows],
            "measure_first": se.measure_first().name if se.measure_first() else None,
            "top_assumption": se.top_assumption().name if se.top_assumption() else None}
