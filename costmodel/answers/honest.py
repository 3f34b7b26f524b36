"""The honest answer to "does the model reproduce DeepSeek's 6.7%?" (`mhcpipe predict --explain`, after the ladder):
the paper's setting predicted under a small, explicit set of stated assumptions (hardware H800 or H200, EP inside a
node or across nodes, sigma 0 or 0.15, mHC kernels on the hardware's memory curve or at the cuTile efficiency, the
other all-to-all dispatcher, GEMMs on Calculon's curve), every mechanism on, nothing fitted to 6.7; the span of the
F&B-stage overhead over those sets, where 6.7% falls in it, and per assumption the mean change between its two
readings over the sets that differ in it alone, with what to measure to settle it. No tolerance band of our
choosing decides anything.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from costmodel.physics.hardware import CALCULON_MATRIX, Curve, HardwareSpec, get_hardware
from costmodel.physics.mhc_cost import ResidualSpec
from costmodel.answers.predict import predict
from costmodel.pricing.pricer import ProfilePricing
from costmodel.pricing.options import Options
from configs import RunConfig

PAPER_PCT = 6.7
"""mHC's overhead at n = 4, "of the overlapped 1F1B pipeline stage" (arXiv 2512.24880 abstract and §4.3;
DeepSeek-V4 report §3.4.2)."""
SIGMA_ALT = 0.15
"""Compute slowdown under an all-to-all read as 20 of 132 SMs (DeepSeek-V3 §3.2.2: 0.152), Calculon's NVLink
`processor_usage` 0.15; here on top of the hardware's SM carve-out (hardware.py), so a pessimistic reading."""
CUTILE_MHC_EFF = Curve(unit="MB", points=[(0, 0.80)])
"""Megatron-LM's cuTile mHC kernels (PR #3828, GB200, 32,768 tokens, C = 7168, n = 4): F_post,res forward moves
4.23 GB in 0.684 ms, F_pre 2.35 GB in 0.349 ms, 75-85% of peak HBM bandwidth (costmodel.md §2.2, mhc.md §8):
a flat 0.80 of peak for every kernel of the groups mhc and recompute (HardwareSpec.mhc_memory_eff), whatever its
size. A GB200 figure read across to Hopper: an assumption, stated as such. The Hopper memory curve tops at 0.896
(the measured H200 copy, hardware.py), so for the large mHC kernels this is the slower reading."""
MEMORY_CURVE, CUTILE = "memory curve", "cuTile 0.80"
HONEST_HARDWARE = ("h800", "h200")
"""DeepSeek's published V3 training GPU (H800) and the project's measured GPU (H200); the paper names none."""


SPEC_GEMM, CALCULON_GEMM = "spec curve", "Calculon 0.95"
"""The GEMM efficiency readings of the honest answer: the spec's matrix curve (Hopper: topped at the H200-measured
0.80, gpu.md §3) or Calculon's A100-tuned curve topped at 0.95 (hardware.CALCULON_MATRIX): sensitivity finds GEMM
efficiency among the inputs that move the overhead most, so the span carries both readings."""


@dataclass
class Variant:
    """One stated assumption set of the honest answer."""

    hardware: str
    ep_layout: str
    sigma: float
    step_pct: float
    fb_pct: float | None
    mhc_kernels: str = MEMORY_CURVE  # the efficiency of the mHC kernels' HBM traffic: MEMORY_CURVE or CUTILE
    dispatcher: str = "DeepEP"  # how an EP group over nodes sends tokens (pricing_options.Options.dispatcher)
    gemm: str = SPEC_GEMM  # the GEMM efficiency curve: the spec's (SPEC_GEMM) or Calculon's (CALCULON_GEMM)
    precision: str = "bf16"  # the linear layers' GEMMs: "bf16" or "FP8" (train.fp8)

    @property
    def gap_pp(self) -> float | None:
        """The F&B-stage overhead minus the paper's 6.7%, in percentage points (costmodel.md §4)."""
        return None if self.fb_pct is None else self.fb_pct - PAPER_PCT


def ep_placements(cfg: RunConfig, hw: HardwareSpec, options: Options) -> tuple[int | None, str, str] | None:
    """(the other placement's ep_per_node, the caller's placement in words, the other one in words), or None
    without expert parallelism (nothing to place)."""
    ep = cfg.parallel.expert_parallel
    if ep <= 1:
        return None
    mine = min(ep, hw.gpus_per_node) if options.ep_per_node is None else min(options.ep_per_node, ep)
    other = mine // 2 if mine >= 2 else None
    if other is None:  # one EP rank per node already: the other placement packs two per node
        other = min(2, ep)

    def words(per: int) -> str:
        nodes = -(-ep // per)
        return f"EP {ep} inside one node" if nodes == 1 else f"EP {ep} over {nodes} nodes ({per} per node)"

    return other, words(mine), words(other)


def honest_variants(cfg: RunConfig, spec: ResidualSpec, options: Options,
                    profile_pricing: ProfilePricing | None = None) -> list[Variant]:
    """The paper's setting under each stated assumption set, every mechanism on (the caller's options): per
    hardware, both EP placements x both sigmas with the mHC kernels on the memory curve, then the caller's
    placement at sigma 0 with them at CUTILE_MHC_EFF, then each placement over nodes at sigma 0 with the other
    dispatcher (an NCCL all-to-all, every token copy on the network, against DeepEP's once per node), then the
    caller's placement at sigma 0 with GEMMs on Calculon's curve (CALCULON_GEMM) where the spec's differs, then
    the caller's placement at sigma 0 with the other GEMM precision (train.fp8 switched, storage recipe with it)
    where the hardware has an FP8 rate."""
    out = []
    mine = "FP8" if cfg.train.fp8 else "bf16"
    flipped = cfg.model_copy(update={"train": cfg.train.model_copy(update={"fp8": not cfg.train.fp8})})
    for name in HONEST_HARDWARE:
        hw = get_hardware(name)
        place = ep_placements(cfg, hw, options)
        layouts = [(options.ep_per_node, place[1]), (place[0], place[2])] if place else [(None, "no EP")]
        own = MEMORY_CURVE if hw.mhc_memory_eff is None else "spec's mHC curve"
        runs = [(hw, per_node, words, sigma, own) for per_node, words in layouts for sigma in (0.0, SIGMA_ALT)]
        runs.append((hw.model_copy(update={"mhc_memory_eff": CUTILE_MHC_EFF}), *layouts[0], 0.0, CUTILE))
        runs = [r + (options.dispatcher,) for r in runs]
        other = "alltoall" if options.dispatcher == "deepep" else "deepep"
        runs += [(hw, per_node, words, 0.0, own, other) for per_node, words in layouts if "nodes" in words]
        runs = [r + (SPEC_GEMM, cfg) for r in runs]
        if hw.matrix_eff != CALCULON_MATRIX:
            runs.append((hw.model_copy(update={"matrix_eff": CALCULON_MATRIX}), *layouts[0], 0.0, own,
                         options.dispatcher, CALCULON_GEMM, cfg))
        if "fp8" in hw.peak_flops:
            runs.append((hw, *layouts[0], 0.0, own, options.dispatcher, SPEC_GEMM, flipped))
        for h, per_node, words, sigma, kernels, disp, gemm, c in runs:
            o = dataclasses.replace(options, ep_per_node=per_node, sigma=sigma, dispatcher=disp)
            s = predict(c, h, spec, o, ladder=False, profile_pricing=profile_pricing).summary
            out.append(Variant(name, words, sigma, s["step_overhead_pct"], s["fb_stage_overhead_pct"], kernels,
                               DISPATCHER_WORDS[disp], gemm, mine if c is cfg else ("bf16" if mine == "FP8" else
                                                                                   "FP8")))
    return out


DISPATCHER_WORDS = {"deepep": "DeepEP", "alltoall": "all-to-all"}

ASSUMPTIONS = {
    "hardware": ("hardware", "which GPU the paper's 6.7% was measured on (unpublished: ask, or read it off a trace)"),
    "ep_layout": ("EP layout", "where the job's EP group sits (one node or across nodes: the all-to-all's "
                  "inter-node bytes in a trace)"),
    "sigma": ("sigma", "a GEMM's time alone and next to a running all-to-all on the target GPU"),
    "mhc_kernels": ("mHC kernels", "the fused mHC kernels' HBM bandwidth on the target GPU (bench/kernel_bench.py)"),
    "dispatcher": ("dispatcher", "which all-to-all the job runs: the inter-node bytes per token of a dispatch in a "
                   "trace (DeepEP's once per remote node, or every copy)"),
    "gemm": ("GEMM efficiency", "the model's GEMMs' achieved TFLOP/s at its shapes on the target GPU (a trace's "
             "GEMM kernels, or a cuBLAS benchmark)"),
    "precision": ("GEMM precision", "whether the job's linear layers ran in FP8 or bf16 (the GEMM kernels' input "
                  "dtype in a trace; the paper does not say)"),
}
"""The honest answer's assumptions: Variant field -> (name, what to measure to tell its readings apart)."""


@dataclass
class Discriminator:
    assumption: str
    mean_pp: float  # mean |change of the F&B-stage overhead| between its readings, the other assumptions held
    pairs: int
    measure: str


def discriminators(variants: list[Variant]) -> list[Discriminator]:
    """Per assumption, the mean change of the F&B-stage overhead between assumption sets that differ in it alone,
    largest first: what a measurement of that assumption would settle."""
    out = []
    for fld, (name, measure) in ASSUMPTIONS.items():
        others = [f for f in ASSUMPTIONS if f != fld]
        groups: dict[tuple, list[Variant]] = {}
        for v in variants:
            if v.fb_pct is not None:
                groups.setdefault(tuple(getattr(v, f) for f in others), []).append(v)
        diffs = [abs(a.fb_pct - b.fb_pct) for g in groups.values() for i, a in enumerate(g) for b in g[i + 1:]
                 if getattr(a, fld) != getattr(b, fld)]
        if diffs:
            out.append(Discriminator(name, sum(diffs) / len(diffs), len(diffs), measure))
    return sorted(out, key=lambda d: -d.mean_pp)


def honest_verdict(variants: list[Variant]) -> str:
    """One sentence from the numbers: the span over the assumption sets and where the paper's 6.7% falls in it."""
    fbs = [v.fb_pct for v in variants if v.fb_pct is not None]
    if not fbs:
        return f"no F&B-stage overhead priced in the {len(variants)} assumption sets (no F&B pairs in this schedule)"
    lo, hi = min(fbs), max(fbs)
    where = ("inside it" if lo <= PAPER_PCT <= hi else
             f"{lo - PAPER_PCT:.2f} pp below it" if PAPER_PCT < lo else f"{PAPER_PCT - hi:.2f} pp above it")
    closest = min((v for v in variants if v.fb_pct is not None), key=lambda v: abs(v.gap_pp))
    return (f"the {len(variants)} assumption sets span {lo:.2f}-{hi:.2f}% of the F&B stage; the paper's {PAPER_PCT}% "
            f"lies {where} (closest: {closest.hardware}, {closest.ep_layout}, {closest.dispatcher}, "
            f"GEMMs {closest.gemm} in {closest.precision}, sigma {closest.sigma:g}, "
            f"{closest.mhc_kernels}, {closest.gap_pp:+.2f} pp). What separates the sets, largest first:")
