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

The honest answer after the ladder (costmodel/answers/honest.py): the paper's setting under stated assumption sets, its
span, and what would tell the sets apart.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from costmodel.physics.hardware import HardwareSpec
from costmodel.physics.mhc_cost import ResidualSpec
from costmodel.answers.predict import Prediction, predict
from costmodel.pricing.pricer import ProfilePricing
from costmodel.pricing.options import Options
from costmodel.answers.honest import (CUTILE, CUTILE_MHC_EFF, MEMORY_CURVE, PAPER_PCT, Variant, discriminators,
                              ep_placements, honest_variants, honest_verdict)
from costmodel.simulation.step_anatomy import anatomy
from configs import RunConfig



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
                  f"{'in':>6}{'F&B stage':>11}{'step':>9}{'vs ' + str(PAPER_PCT) + '%':>10}"]
        for v in ex.variants:
            gap = "n/a" if v.gap_pp is None else f"{v.gap_pp:+.2f} pp"
            lines.append(f"  {v.hardware:<9}{v.ep_layout:<34}{v.sigma:>6.2f}{v.mhc_kernels:>14}{v.dispatcher:>11}"
                         f"{v.gemm:>15}{v.precision:>6}{_pct(v.fb_pct):>11}{_pct(v.step_pct):>9}{gap:>10}")
        lines.append("  " + honest_verdict(ex.variants))
        for d in discriminators(ex.variants):
            lines.append(f"    {d.assumption}: {d.mean_pp:.2f} pp between its readings ({d.pairs} pairs); "
                         f"to settle it, measure {d.measure}")
        lines.append(f"  mHC kernels: {MEMORY_CURVE} = the hardware's HBM efficiency curve; {CUTILE} = a flat 0.80 of "
                     "peak HBM bandwidth (Megatron-LM cuTile kernels on GB200, 75-85%, costmodel.md §2.2)")
    return "\n".join(lines)


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
