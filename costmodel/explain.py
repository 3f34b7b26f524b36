"""`mhcpipe predict --explain`: the road from naive eager mHC to the design's overhead, one mechanism at a time,
and an honest answer to "does the model reproduce DeepSeek's 6.7%?".

Shape letters: T tokens per micro-batch, C hidden, n residual streams, d bytes per element, P pipeline ranks,
M micro-batches, EP expert-parallel degree, g GPUs per node.

The ladder (each rung changes one switch of the previous one, and says which; costmodel.md §5, mhc.md §6):
  0 naive eager mHC: unfused kernels (mHC Table 2 I/O, eager Sinkhorn), no recompute, every action serial (an
    F&B pair is F then B, a single action's all-to-alls do not overlap its own compute), MLP post+res on the
    normal stream
  1 + fused kernels (the TileKernels I/O of costmodel.md §2.2)
  2 + stage-aligned recompute of the mHC intermediates (mHC §4.3.2; it costs time and saves memory). The plain
    residual recomputes its norm under the same config, so the baseline moves too: its column shows by how much.
  3 + stream pricing of single actions: F, I, W and B run their kernels and all-to-alls on the three streams
    (Options.single_mode; pairs still serial)
  4 + DualPipe pair overlap: the F&B pairs priced as the caller's fb_mode ("streams" by default)
  5 + MLP post+res on the high-priority stream
Every rung runs on the caller's layout and EP placement, so the last rung is `predict`'s headline to the digit.
The other EP placement (when the config's EP group fits in a node, EP <= g, split over two nodes: part of every
all-to-all crosses the network; when it already spans nodes, over twice as many) is one of the stated assumption
sets of the honest answer below.
Every rung is a full `predict` of mHC and of the baseline (n = 1) under the same options (like for like), so the
last rung is the plain prediction with the caller's options. One denominator for every rung: the last rung's
baseline F&B stage (fb_stage.py; the step where the schedule has no F&B pairs). A rung's row is the ms mHC adds
over its own baseline, that baseline's ms, and the added ms as a share of the one denominator, so the rows read
as a waterfall of mHC's added time; a rung that also moves the baseline shows it in the baseline's column instead
of in a moving percentage. A rung whose switch is already at the caller's value changes nothing and says so.
Per pair kind (forward stage, backward stage) the last rung's pairs: how often each runs, priced alone and as run;
and each pair kind's overhead (priced alone) at every rung, with what each mechanism changes there (`MECHANISMS`:
fused kernels rung 1 - 0, stage-aligned recompute 2 - 1, DualPipe's overlap 4 - 3, hp placement 5 - 4, in pp
of the pair's own baseline), so a reader sees where each one pays. The last rung is `predict` itself (with its
ladder): its split of the step overhead (kernel traffic, recompute, n-fold boundary traffic, gradient sync) is
the one `predict` prints, the same numbers.

The honest answer: a small, explicit set of stated assumptions for the paper's setting (hardware H800 or H200,
EP inside a node or across nodes, sigma 0 or 0.15, mHC kernels on the hardware's memory curve), each predicted
with every mechanism on; plus, per hardware, the caller's EP placement at sigma 0 with the mHC kernels at the
cuTile efficiency (CUTILE_MHC_EFF) instead. It reports the span of the F&B-stage overhead over those sets, where
the paper's 6.7% falls in it (each set's gap in pp), and what would discriminate them: per assumption, the mean
change between its two readings over the sets that differ in it alone, with what to measure to settle it.
No tolerance band of our choosing decides anything. Nothing is fitted to 6.7.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from costmodel.hardware import CALCULON_MATRIX, Curve, HardwareSpec, get_hardware
from costmodel.mhc_cost import ResidualSpec
from costmodel.predict import Prediction, predict
from costmodel.pricing import Options, ProfilePricing
from costmodel.step_anatomy import anatomy
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


@dataclass
class Rung:
    """One step of the ladder: what it switched and what mHC costs there, like for like."""

    name: str
    change: str
    spec: ResidualSpec
    options: Options
    same_as_previous: bool = False
    summary: dict[str, Any] = field(default_factory=dict)  # predict's summary
    mhc: dict[str, Any] = field(default_factory=dict)  # step_anatomy.anatomy of the mHC run
    baseline: dict[str, Any] = field(default_factory=dict)  # ... and of the baseline run

    @property
    def step_pct(self) -> float:
        return self.summary["step_overhead_pct"]

    @property
    def fb_pct(self) -> float | None:
        return self.summary["fb_stage_overhead_pct"]

    def measure_us(self, name: str, fb: bool) -> float:
        """The ladder's measure for `name` (baseline or mhc): the F&B stage per rank (fb), or the step."""
        return self.summary["fb_stage_us"][name] if fb else self.summary["iteration_us"][name]


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
    dispatcher: str = "DeepEP"  # how an EP group over nodes sends tokens (pricing.Options.dispatcher)
    gemm: str = SPEC_GEMM  # the GEMM efficiency curve: the spec's (SPEC_GEMM) or Calculon's (CALCULON_GEMM)

    @property
    def gap_pp(self) -> float | None:
        """The F&B-stage overhead minus the paper's 6.7%, in percentage points (costmodel.md §4)."""
        return None if self.fb_pct is None else self.fb_pct - PAPER_PCT


@dataclass
class Explanation:
    config: str
    hardware: str
    rungs: list[Rung]
    ep_note: str
    variants: list[Variant]

    @property
    def on_fb_stage(self) -> bool:
        """The ladder's measure: the F&B stage when the schedule has pairs, else the step."""
        return self.rungs[-1].summary["fb_stage_us"]["baseline"] is not None

    @property
    def measure(self) -> str:
        return "F&B stage" if self.on_fb_stage else "step"

    @property
    def denominator_us(self) -> float:
        """The one denominator of every rung's share: the last rung's baseline measure."""
        return self.rungs[-1].measure_us("baseline", self.on_fb_stage)

    def added_us(self, r: Rung) -> float:
        return r.measure_us("mhc", self.on_fb_stage) - r.measure_us("baseline", self.on_fb_stage)

    def share_pct(self, r: Rung) -> float:
        return 100.0 * self.added_us(r) / self.denominator_us

    def step_share_pct(self, r: Rung) -> float:
        """The step's ms mHC adds on this rung over the last rung's baseline step (one denominator too)."""
        it = r.summary["iteration_us"]
        return 100.0 * (it["mhc"] - it["baseline"]) / self.rungs[-1].summary["iteration_us"]["baseline"]


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


def ladder_steps(cfg: RunConfig, hw: HardwareSpec, spec: ResidualSpec,
                 options: Options) -> tuple[list[tuple[str, str, ResidualSpec, Options]], str]:
    """The rungs as (name, change, spec, options), and a note on the EP placement. The last rung's spec and
    options are the caller's."""
    options = dataclasses.replace(options, single_mode=options.single_action_mode)  # the same prediction, explicit
    place = ep_placements(cfg, hw, options)
    s0 = dataclasses.replace(spec, fused=False) if not spec.is_baseline else spec
    # every rung on the caller's layout and EP placement: the last rung is `predict`'s own headline
    o = dataclasses.replace(options, fb_mode="serial", single_mode="serial", hp_stream=False, recompute=False)
    steps = [("naive eager", "unfused kernels, no recompute, every action serial, no hp stream", s0, o)]
    steps.append(("+ fused kernels", "fused mHC kernels (TileKernels I/O)" if spec.fused
                  else "--unfused in your options", spec, o))
    o = dataclasses.replace(o, recompute=options.recompute)
    rc = "stage-aligned recompute of mHC intermediates" if options.recompute else "recompute off in your options"
    if cfg.recompute.mode == "off":
        rc = "recompute.mode is off in the config: nothing to recompute"
    steps.append(("+ recompute", rc, spec, o))
    o = dataclasses.replace(o, single_mode=options.single_mode)
    steps.append(("+ stream singles", f"F, I, W, B priced as single_mode={options.single_mode!r} (kernels and "
                  "all-to-alls on the streams; pairs still serial)", spec, o))
    o = dataclasses.replace(o, fb_mode=options.fb_mode)
    steps.append(("+ pair overlap", f"F&B pairs priced as fb_mode={options.fb_mode!r} (DualPipe's overlap)",
                  spec, o))
    o = dataclasses.replace(o, hp_stream=options.hp_stream)
    steps.append(("+ hp stream", "MLP post+res on the high-priority stream" if options.hp_stream
                  else "hp stream off in your options", spec, o))
    if place:
        note = (f"EP layout: every rung uses {place[1]} (your placement, as predict prices it); {place[2]} is among "
                "the stated assumptions below")
    else:
        note = "EP layout: no expert parallelism (EP = 1), nothing to place"
    assert steps[-1][2] == spec and steps[-1][3] == options, "the last rung must be the caller's prediction"
    return steps, note


def _predict(cfg: RunConfig, hw: HardwareSpec, spec: ResidualSpec, options: Options,
             profile_pricing: ProfilePricing | None, ladder: bool = False) -> Prediction:
    return predict(cfg, hw, spec, options, ladder=ladder, profile_pricing=profile_pricing)


MECHANISMS = (("fused kernels", 1, 0), ("recompute", 2, 1), ("pair overlap", 4, 3), ("hp stream", 5, 4))
"""The mechanisms per pair kind: (name, rung, the rung before it), the overhead change between them."""


def pairs_by_rung(ex: "Explanation") -> list[dict[str, Any]]:
    """Per pair kind of the last rung: its alone overhead at every rung and each mechanism's change (pp)."""
    out = []
    for p in ex.rungs[-1].summary["fb_pairs"]:
        key = (p["f_stage"], p["b_stage"])
        pct = []
        for r in ex.rungs:
            row = next((q for q in r.summary["fb_pairs"] if (q["f_stage"], q["b_stage"]) == key), None)
            pct.append(None if row is None else row["alone_pct"])
        mech = {name: (pct[a] - pct[b] if a < len(pct) and pct[a] is not None and pct[b] is not None else None)
                for name, a, b in MECHANISMS}
        out.append({"pair": f"{key[0]}/{key[1]}", "count": p["count"], "alone_pct_by_rung": pct, "mechanisms_pp": mech})
    return out


def honest_variants(cfg: RunConfig, spec: ResidualSpec, options: Options,
                    profile_pricing: ProfilePricing | None = None) -> list[Variant]:
    """The paper's setting under each stated assumption set, every mechanism on (the caller's options): per
    hardware, both EP placements x both sigmas with the mHC kernels on the memory curve, then the caller's
    placement at sigma 0 with them at CUTILE_MHC_EFF, then each placement over nodes at sigma 0 with the other
    dispatcher (an NCCL all-to-all, every token copy on the network, against DeepEP's once per node), then the
    caller's placement at sigma 0 with GEMMs on Calculon's curve (CALCULON_GEMM) where the spec's differs."""
    out = []
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
        runs = [r + (SPEC_GEMM,) for r in runs]
        if hw.matrix_eff != CALCULON_MATRIX:
            runs.append((hw.model_copy(update={"matrix_eff": CALCULON_MATRIX}), *layouts[0], 0.0, own,
                         options.dispatcher, CALCULON_GEMM))
        for h, per_node, words, sigma, kernels, disp, gemm in runs:
            o = dataclasses.replace(options, ep_per_node=per_node, sigma=sigma, dispatcher=disp)
            s = _predict(cfg, h, spec, o, profile_pricing).summary
            out.append(Variant(name, words, sigma, s["step_overhead_pct"], s["fb_stage_overhead_pct"], kernels,
                               DISPATCHER_WORDS[disp], gemm))
    return out


def explain(cfg: RunConfig, hw: HardwareSpec, spec: ResidualSpec, options: Options,
            profile_pricing: ProfilePricing | None = None, honest: bool = True) -> Explanation:
    if spec.is_baseline:
        raise ValueError("--explain: the residual is the plain baseline (n=1): there is no mHC overhead to explain; "
                         "use --variant mhc (or --n 4)")
    steps, note = ladder_steps(cfg, hw, spec, options)
    rungs: list[Rung] = []
    for i, (name, change, s, o) in enumerate(steps):
        pred = _predict(cfg, hw, s, o, profile_pricing, ladder=i == len(steps) - 1)  # the last: predict itself
        same = bool(rungs) and rungs[-1].spec == s and rungs[-1].options == o
        rungs.append(Rung(name, change, s, o, same, pred.summary,
                          anatomy(pred.pricers["mhc"], pred.mhc, pred.schedule),
                          anatomy(pred.pricers["baseline"], pred.baseline, pred.schedule)))
    variants = honest_variants(cfg, spec, options, profile_pricing) if honest else []
    return Explanation(cfg.model.name, hw.name, rungs, note, variants)


# ---- output ------------------------------------------------------------------------------------------------
def _pct(v: float | None) -> str:
    return "   n/a" if v is None else f"{v:6.2f}%"


def _ms(us: float | None) -> str:
    return "n/a" if us is None or us != us else f"{us / 1e3:,.2f}"


def format_explain(ex: Explanation) -> str:
    final = ex.rungs[-1]
    what = "per rank, every pair as the step runs it" if ex.on_fb_stage else "the step (no F&B pairs in this schedule)"
    lines = [f"mhcpipe predict --explain: {ex.config} on {ex.hardware}, {final.spec.label()} vs residual (n=1)",
             f"  mHC overhead: {_pct(final.fb_pct).strip()} of the overlapped F&B stage (like for like with the "
             f"paper's {PAPER_PCT}%), {_pct(final.step_pct).strip()} of the step",
             f"  {ex.ep_note}",
             f"  one denominator for every rung: the last rung's baseline {ex.measure}, "
             f"{ex.denominator_us / 1e3:,.2f} ms ({what})", "",
             f"  {'rung':<20}{'mHC adds':>10}{'baseline':>11}{'% of the':>10}{'own':>9}{'step':>9}",
             f"  {'':<20}{'ms':>10}{'ms':>11}{'last base':>10}{'base %':>9}{'%':>9}"]
    for i, r in enumerate(ex.rungs):
        own = r.fb_pct if ex.on_fb_stage else r.step_pct
        base = r.measure_us("baseline", ex.on_fb_stage)
        lines.append(f"  {f'{i} {r.name}':<20}{_ms(ex.added_us(r)):>10}{_ms(base):>11}"
                     f"{ex.share_pct(r):>9.2f}%{_pct(own):>9}{_pct(r.step_pct):>9}")
    lines += ["", f"  {'rung':<20}{'resid. HBM':>12}{'boundary':>10}{'exposed A2A':>13}{'exposed P2P':>13}"
              "  critical path (mHC)",
              f"  {'':<20}{'GB/rank':>12}{'GB/rank':>10}{'ms/rank':>13}{'ms/rank':>13}"]
    for i, r in enumerate(ex.rungs):
        m = r.mhc
        lines.append(f"  {f'{i} {r.name}':<20}"
                     f"{m['residual_bytes_per_rank'] / 1e9:>12.4g}{m['boundary_bytes_per_rank'] / 1e9:>10.4g}"
                     f"{m['a2a_exposed_us'] / 1e3:>13.2f}{r.summary['exposed_comm_us']['mhc'] / 1e3:>13.2f}  "
                     f"{m['critical_path']['text']}")
    pairs = final.summary["fb_pairs"]
    if pairs:
        lines += ["", "  the last rung's F&B pairs per kind (forward stage / backward stage): alone = inputs on time, "
                  "as run = the simulated step",
                  f"  {'pair':<8}{'runs':>6}{'alone ms':>18}{'alone':>9}{'as run ms':>18}{'as run':>9}",
                  f"  {'':<8}{'':>6}{'base -> mHC':>18}{'%':>9}{'base -> mHC':>18}{'%':>9}"]
        for p in pairs:
            al, ar = p["alone_us"], p["as_run_us"]
            lines.append(f"  {str(p['f_stage']) + '/' + str(p['b_stage']):<8}{p['count']:>6}"
                         f"{_ms(al['baseline']) + ' -> ' + _ms(al['mhc']):>18}{_pct(p['alone_pct']):>9}"
                         f"{_ms(ar['baseline']) + ' -> ' + _ms(ar['mhc']):>18}{_pct(p['as_run_pct']):>9}")
    by_pair = pairs_by_rung(ex)
    if by_pair:
        names = [m[0] for m in MECHANISMS]
        lines += ["", "  where each mechanism pays, per pair kind: the pair's mHC overhead priced alone at every rung, "
                  "then each mechanism's change (pp of the pair's own baseline)",
                  f"  {'pair':<8}{'runs':>6}" + "".join(f"{'r' + str(i):>8}" for i in range(len(ex.rungs)))
                  + "".join(f"{n:>15}" for n in names)]
        def cell(v: float | None, fmt: str, width: int) -> str:
            return f"{'n/a' if v is None else format(v, fmt):>{width}}"

        for row in by_pair:
            lines.append(f"  {row['pair']:<8}{row['count']:>6}"
                         + "".join(cell(v, '.2f', 7) + "%" for v in row["alone_pct_by_rung"])
                         + "".join(cell(row["mechanisms_pp"][n], "+.2f", 15) for n in names))
    b = final.summary["breakdown_pp"]
    lines += ["", f"  the headline's {final.step_pct:.2f}% of the step, split as `predict` splits it: kernel traffic "
              f"{b['kernel_traffic']:+.2f} + recompute {b['recompute']:+.2f} + n-fold boundary traffic "
              f"{b['exposed_comm']:+.2f} + gradient sync {b['gradient_sync']:+.2f} pp"]
    lines += ["", "  what each rung changes (mHC; baseline in brackets):"]
    for i, r in enumerate(ex.rungs):
        m, b, it = r.mhc, r.baseline, r.summary["iteration_us"]
        extra = " (same switches as the previous rung: nothing changes)" if r.same_as_previous else ""
        lines.append(f"  {i} {r.name}: {r.change}{extra}")
        lines.append(f"      step {it['mhc'] / 1e3:,.1f} ms [{it['baseline'] / 1e3:,.1f}]; residual HBM "
                     f"{m['residual_bytes_per_rank'] / 1e9:.4g} GB/rank [{b['residual_bytes_per_rank'] / 1e9:.4g}]; "
                     f"exposed A2A {m['a2a_exposed_us'] / 1e3:.2f} of {m['a2a_total_us'] / 1e3:.2f} ms/rank "
                     f"[{b['a2a_exposed_us'] / 1e3:.2f} of {b['a2a_total_us'] / 1e3:.2f}]; "
                     f"peak memory {r.summary['memory_gib']['mhc']:.1f} GiB "
                     f"[{r.summary['memory_gib']['baseline']:.1f}]")
    if ex.variants:
        lines += ["", f"  honest answer: the paper's {PAPER_PCT}% is of the overlapped F&B stage, hardware and layout "
                  "unpublished; every mechanism on, nothing fitted. Each stated assumption set:",
                  f"  {'hardware':<9}{'EP layout':<34}{'sigma':>6}{'mHC kernels':>14}{'dispatch':>11}{'GEMMs':>15}"
                  f"{'F&B stage':>11}{'step':>9}{'vs ' + str(PAPER_PCT) + '%':>10}"]
        for v in ex.variants:
            gap = "n/a" if v.gap_pp is None else f"{v.gap_pp:+.2f} pp"
            lines.append(f"  {v.hardware:<9}{v.ep_layout:<34}{v.sigma:>6.2f}{v.mhc_kernels:>14}{v.dispatcher:>11}"
                         f"{v.gemm:>15}{_pct(v.fb_pct):>11}{_pct(v.step_pct):>9}{gap:>10}")
        lines.append("  " + honest_verdict(ex.variants))
        for d in discriminators(ex.variants):
            lines.append(f"    {d.assumption}: {d.mean_pp:.2f} pp between its readings ({d.pairs} pairs); "
                         f"to settle it, measure {d.measure}")
        lines.append(f"  mHC kernels: {MEMORY_CURVE} = the hardware's HBM efficiency curve; {CUTILE} = a flat 0.80 of "
                     "peak HBM bandwidth (Megatron-LM cuTile kernels on GB200, 75-85%, costmodel.md §2.2)")
    return "\n".join(lines)


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
            f"GEMMs {closest.gemm}, sigma {closest.sigma:g}, "
            f"{closest.mhc_kernels}, {closest.gap_pp:+.2f} pp). What separates the sets, largest first:")


def to_json(ex: Explanation) -> dict[str, Any]:
    return {
        "config": ex.config, "hardware": ex.hardware, "ep_note": ex.ep_note,
        "paper_pct": PAPER_PCT,
        "measure": ex.measure, "denominator_us": ex.denominator_us,
        "fb_pairs": ex.rungs[-1].summary["fb_pairs"],
        "pairs_by_rung": pairs_by_rung(ex),
        "headline_breakdown_pp": ex.rungs[-1].summary["breakdown_pp"],
        "rungs": [{"name": r.name, "change": r.change, "residual": r.spec.label(),
                   "options": dataclasses.asdict(r.options), "same_as_previous": r.same_as_previous,
                   "added_us": ex.added_us(r), "share_of_last_baseline_pct": ex.share_pct(r),
                   "step_share_of_last_baseline_pct": ex.step_share_pct(r),
                   "fb_stage_us": r.summary["fb_stage_us"],
                   "fb_stage_overhead_pct": r.fb_pct, "step_overhead_pct": r.step_pct,
                   "iteration_us": r.summary["iteration_us"], "exposed_p2p_us": r.summary["exposed_comm_us"],
                   "memory_gib": r.summary["memory_gib"], "mhc": r.mhc, "baseline": r.baseline}
                  for r in ex.rungs],
        "honest_answer": {"variants": [dataclasses.asdict(v) | {"gap_pp": v.gap_pp} for v in ex.variants],
                          "verdict": honest_verdict(ex.variants) if ex.variants else None,
                          "discriminators": [dataclasses.asdict(d) for d in discriminators(ex.variants)],
                          "mhc_kernels": {MEMORY_CURVE: "the hardware's memory_eff curve",
                                          CUTILE: CUTILE_MHC_EFF.model_dump()}},
    }
