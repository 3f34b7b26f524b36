"""RuntimeProfileFit: this runtime's `local` RuntimeProfile fitted on a measured BASELINE run (costmodel.md §3;
a costmodel.fitting.trace_fit.TraceFitter, used through fit_trace).

Model (shared_cores.py): every compute action is full-speed *work*; the ranks that want to compute are
scheduled on the host's cores in time slices (the slice measured) so that k busy ranks progress at cores(k)
in total (measured, core_sharing.py); the executor spends full-speed work `gap` before each action; a
stage-boundary message takes alpha + bytes / bandwidth.

The fit, on the steady-state steps of the baseline trace (the first step is dropped):
* gap: the median measured gap between two compute actions that waited for no receive;
* work per action key ('F/s3', 'FB/s3+s4'): a measured duration already contains the sharing of the cores at
  that moment and the simulation applies the sharing again, so the measured duration is only where the fit
  starts: each round scales every key's work by the square root of its measured over its simulated duration,
  until the simulated baseline reproduces the measured ones (fit_work; work stays at most the measured duration,
  since sharing only slows). The target is the key's median, not its mean: the simulation already makes a rank
  lose time slices to the others, and the mean of a short action carries the slices it lost in the run a second
  time;
* alpha, around that: bisected so that the simulated baseline step equals the measured median step, the work
  refitted at every alpha. It takes up what the model does not have (gloo progress, waking a descheduled
  receiver, an executor preempted between two actions); the directly measured message latency (producer end to
  waiting consumer start, meta `message_latency_us`) is reported next to it;
* the residual's extra cost per kind: its micro-benchmarked extra (the stage timings the fitter is built with)
  x that kind's in-pipeline factor, the measured median of the block-only baseline stages over the same blocks
  micro-benchmarked (meta `insitu_over_bench`: F, I, W, B and `all`). Inside the pipeline the same code runs at
  another speed than in the micro-benchmark, because of what runs between two actions of a rank and because a
  shared host's speed moves between the micro-benchmark and the run; a factor per kind follows that better
  than one factor for all kinds or none (bench/predict_local.py measures it).
The mHC run is never an input: a trace of another residual is refused (fit_trace).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from costmodel.physics.hardware import HardwareSpec
from costmodel.local.host_pricing import HostPricing
from costmodel.physics.mhc_cost import ResidualSpec
from costmodel.pricing.pricer import Pricer
from costmodel.pricing.stage_split import resolve_layout
from costmodel.pricing.options import Options
from costmodel.physics.runtime_profile import RuntimeProfile, runtime_key
from costmodel.fitting.trace_fit import RUNTIME_KINDS, TraceFit, action_key, check_baseline_trace, nested_in_fb
from schedules.build import build
from traces.analysis.matching import step_index

STALL_FACTOR = 5.0  # a duration above this many medians of its key is a stall (page faults, VM steal), not sharing
WORK_ROUNDS = 6  # rounds of fit_work: enough for the simulated durations to settle within a few % of the targets


def steady_steps(trace, skip_steps: int = 1) -> dict[int, list[int]]:
    """step -> indices of its schedule spans, without the first `skip_steps` steps (all when that leaves none)."""
    steps = step_index(trace)
    nsteps = 1 + max(steps.values(), default=-1)
    skip = skip_steps if nsteps > skip_steps else 0
    out: dict[int, list[int]] = {}
    for i, k in steps.items():
        if k >= skip:
            out.setdefault(k, []).append(i)
    return out


def action_durations(trace, skip_steps: int = 1) -> dict[str, list[float]]:
    """Per action key, the durations of its steady-state instances (FB halves excluded)."""
    halves = nested_in_fb(trace.spans)
    out: dict[str, list[float]] = {}
    for idx in steady_steps(trace, skip_steps).values():
        for i in idx:
            s = trace.spans[i]
            if s.kind in RUNTIME_KINDS and i not in halves:
                out.setdefault(action_key(s), []).append(s.duration)
    return out


def robust_mean(values: list[float]) -> float:
    """Mean without stalls (values above STALL_FACTOR x the median): the time sharing is in the mean, a page-fault
    storm or a descheduled VM is not."""
    med = statistics.median(values)
    kept = [v for v in values if v <= STALL_FACTOR * med] or values
    return statistics.fmean(kept)


def baseline_action_stats(trace, skip_steps: int = 1) -> tuple[dict[str, float], dict[str, float], int]:
    """(mean and median duration per action key, steps used) of a measured baseline trace's steady state."""
    check_baseline_trace(trace)
    durs = action_durations(trace, skip_steps)
    if not durs:
        raise ValueError("the baseline trace has no F/I/W/B/FB spans named as in traces.md §5")
    return ({k: robust_mean(v) for k, v in durs.items()}, {k: statistics.median(v) for k, v in durs.items()},
            len(steady_steps(trace, skip_steps)))


def gaps_and_makespan(trace, skip_steps: int = 1) -> tuple[float, float]:
    """(median gap before a compute action that waited for no receive, on its rank's clock; median step makespan
    as traces.analysis.compare measures it), over the steady-state steps."""
    spans = trace.spans
    halves = nested_in_fb(spans)
    gaps, makespans = [], []
    for idx in steady_steps(trace, skip_steps).values():
        ss = [spans[i] for i in idx]
        makespans.append(max(s.end for s in ss) - min(s.start for s in ss))
        by_rank: dict[int, list] = {}
        for i in idx:
            if i not in halves:
                by_rank.setdefault(spans[i].rank, []).append(spans[i])
        for lst in by_rank.values():
            comp = sorted((s for s in lst if s.kind in RUNTIME_KINDS), key=lambda s: s.start)
            recv_ends = [s.end for s in lst if s.kind.startswith("RECV")]
            for a, b in zip(comp, comp[1:]):
                if not any(a.end < e <= b.start for e in recv_ends):
                    gaps.append(max(0.0, b.start - a.end))
    return (statistics.median(gaps) if gaps else 0.0), (statistics.median(makespans) if makespans else 0.0)


def _baseline_pricer(cfg, hw):
    base = cfg.with_residual("residual", 1)
    sched = build(cfg.parallel.schedule, cfg.parallel.ranks, cfg.parallel.microbatches)
    pricer = Pricer(base, hw, ResidualSpec.baseline(), resolve_layout(base, sched, True), Options(),
                    profile_pricing=HostPricing())
    return pricer, sched


def message_latencies(trace, schedule, skip_steps: int = 1) -> list[float]:
    """Steady-state times from a producer's compute end to its consumer's start on another rank, where the consumer
    had nothing else to run (its previous compute ended before the producer's did): what one stage-boundary
    message costs the pipeline. F(s, m) consumes F(prev(s), m); B/I(s, m) consumes B/I(next(s), m) along the
    schedule's pipelines. Needs the overlapped F&B's halves as spans (the runtime records them)."""
    prev, nxt = {}, {}
    for chain in schedule.pipelines:
        for a, b in zip(chain, chain[1:]):
            nxt[a], prev[b] = b, a
    spans, out = trace.spans, []
    for idx in steady_steps(trace, skip_steps).values():
        by_key, by_rank = {}, {}
        for i in idx:
            s = spans[i]
            if s.kind in ("F", "B", "I"):
                by_key[("F" if s.kind == "F" else "B", s.stage, s.mb)] = s
            if s.kind in RUNTIME_KINDS:
                by_rank.setdefault(s.rank, []).append(s)
        for (kind, stage, mb), s in by_key.items():
            src = prev.get(stage) if kind == "F" else nxt.get(stage)
            p = by_key.get((kind, src, mb))
            if p is None or p.rank == s.rank:
                continue
            busy_until = max((o.end for o in by_rank[s.rank] if o.end <= s.start + 1e-6 and o is not s),
                             default=None)
            if busy_until is None or busy_until < p.end:
                out.append(s.start - p.end)
    return out


def simulated_medians(cfg, hw) -> tuple[dict[str, float], float]:
    """(median simulated duration per action key, makespan) of the baseline simulated on `hw`'s runtime profile."""
    pricer, sched = _baseline_pricer(cfg, hw)
    sim = pricer.simulate(sched)
    durs: dict[str, list[float]] = {}
    for s in sim.trace.spans:
        if s.kind in RUNTIME_KINDS:
            durs.setdefault(action_key(s), []).append(s.duration)
    return {k: statistics.median(v) for k, v in durs.items()}, sim.makespan


def fit_work(cfg, hw, targets: dict[str, float], rounds: int = WORK_ROUNDS) -> tuple[dict[str, float], float]:
    """(full-speed work per action key whose shared-cores simulation on `hw` reproduces the measured durations
    `targets`, the simulated step). Damped (square root of the ratio per round): the sharing a key sees depends on
    every other key's work."""
    work, makespan = dict(targets), 0.0
    for _ in range(rounds + 1):
        sim, makespan = simulated_medians(cfg, hw.model_copy(update={"runtime": hw.runtime.model_copy(
            update={"action_us": work})}))
        work = {k: min(targets[k], v * (targets[k] / sim[k]) ** 0.5) if sim.get(k) else v for k, v in work.items()}
    return work, makespan


def fit_work_and_latency(cfg, hw, targets: dict[str, float], target_us: float,
                         iters: int = 14) -> tuple[dict[str, float], float]:
    """(work per key, alpha): the work reproduces the measured durations at that alpha (fit_work), and alpha is
    bisected so that the simulated step equals `target_us` (0 when it is already at least as long)."""
    def at(alpha: float) -> tuple[dict[str, float], float]:
        return fit_work(cfg, hw.model_copy(update={"runtime": hw.runtime.model_copy(
            update={"p2p_latency_us": alpha})}), targets)

    work, span = at(0.0)
    if span >= target_us:
        return work, 0.0
    lo, hi = 0.0, max(target_us / 8, 1.0)
    while at(hi)[1] < target_us and hi < 100 * target_us:
        lo, hi = hi, hi * 2
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if at(mid)[1] < target_us else (lo, mid)
    alpha = 0.5 * (lo + hi)
    return at(alpha)[0], alpha


@dataclass
class RuntimeProfileFit:
    """costmodel.fitting.trace_fit.TraceFitter for `local` (module docstring), built with the host measurements:
    `stage_us` (pipeline.launch.host_measurements.time_stage_pieces: {"block": {F, I, W, B} of one baseline block,
    "residual": {"variant:n": pieces}}), `cores` (cores(k), core_sharing.measure_core_sharing), the OS time slice
    and the protection after a wake-up (core_sharing). The input spec's link prices the message bytes; the
    result is that spec with the fitted profile."""

    stage_us: dict
    cores: list[float]
    time_slice_us: float = 0.0
    protect_us: float = 0.0
    skip_steps: int = 1

    def fit(self, trace, cfg, hw_base: HardwareSpec) -> TraceFit:
        bench, skip_steps = self.stage_us, self.skip_steps
        means, medians, used = baseline_action_stats(trace, skip_steps)
        gap, makespan = gaps_and_makespan(trace, skip_steps)
        lat = message_latencies(trace, _baseline_pricer(cfg, hw_base)[1], skip_steps)
        profile = RuntimeProfile(key=runtime_key(cfg), action_us=dict(medians), residual_us=bench.get("residual", {}),
                                 action_overhead_us=gap, cores_by_concurrency=list(self.cores),
                                 time_slice_us=self.time_slice_us, protect_us=self.protect_us)
        # the simulation takes the time slices away again, so the work reproduces the median; alpha takes up the
        # rest of the measured step
        work, alpha = fit_work_and_latency(cfg, hw_base.model_copy(update={"runtime": profile}), medians, makespan)
        factors = insitu_factors(medians, cfg, bench)
        profile = profile.model_copy(update={
            "action_us": work, "p2p_latency_us": alpha,
            "residual_us": {key: scale_residual(pieces, factors) for key, pieces in bench.get("residual", {}).items()},
            "meta": {"measured_mean_us": means, "measured_median_us": medians, "block_bench_us": bench.get("block", {}),
                     "residual_bench_us": bench.get("residual", {}), "bench_raw_us": bench.get("raw_us", {}),
                     "insitu_over_bench": factors, "steps_used": used, "baseline_makespan_us": makespan,
                     "message_latency_us": {"mean": statistics.fmean(lat), "median": statistics.median(lat),
                                            "n": len(lat)} if lat else None,
                     "source": trace.meta.get("source")}})
        return TraceFit(hw_base.model_copy(update={"runtime": profile}), medians)


PIECE_KIND = {"fwd": "F", "expand_fwd": "F", "contract_fwd": "F", "bwd": "I", "rc": "I", "expand_bwd": "I",
              "contract_bwd": "I", "w": "W"}  # the action kind each residual piece runs in ("b": see below)


def scale_residual(pieces: dict[str, float], factors: dict[str, float]) -> dict[str, float]:
    """Micro-benchmarked residual pieces x the in-pipeline factor of the kind they run in. A kind the baseline
    has no block-only stage of takes the factor over all kinds (`all`), else 1.

    The full backward's piece `b` is the residual's input-gradient work (`bwd`) plus its weight-gradient work
    (`w`, a few % of it on CPU), so it takes the factors of I and W weighted by those two pieces, not the
    baseline B's factor: that one weights W by the baseline block's GEMM weight gradients (about a fifth of its
    B), which run slower in the pipeline than its input gradients, and they are not what the residual adds.

    The weight-gradient piece `w` is used as micro-benchmarked, without the baseline W's factor (here and in
    that blend): the baseline W's factor is its GEMMs', while the residual's W piece is a small elementwise
    part whose in-pipeline speed that factor does not describe (bench/predict_local.py compares both ways)."""
    fallback = factors.get("all", 1.0)
    kind_factor = {**factors, "W": 1.0}
    out = {p: v * kind_factor.get(PIECE_KIND[p], fallback) for p, v in pieces.items() if p in PIECE_KIND}
    if "b" in pieces:
        i_part, w_part = pieces.get("bwd", 0.0), pieces.get("w", 0.0)
        if i_part + w_part > 0:
            blend = (i_part * factors.get("I", fallback) + w_part * kind_factor["W"]) / (i_part + w_part)
        else:
            blend = factors.get("B", fallback)
        out["b"] = pieces["b"] * blend
    out.update({p: v * fallback for p, v in pieces.items() if p not in out})
    return out


def insitu_factors(work: dict[str, float], cfg, bench: dict) -> dict[str, float]:
    """Per kind F, I, W, B: the measured (median) durations `work` of the block-only stages over the same blocks
    micro-benchmarked in one process, and `all` over every such action: how much slower (or faster) the code
    runs inside the pipeline. Kinds without a block-only stage are left out."""
    block = bench.get("block") or {}
    sched = build(cfg.parallel.schedule, cfg.parallel.ranks, cfg.parallel.microbatches)
    layout = resolve_layout(cfg, sched, True)  # stage -> (blocks, first of its pipeline, last)
    fitted: dict[str, float] = {}
    benched: dict[str, float] = {}
    for key, v in work.items():
        kind, st = key.split("/")[0], int(key.split("/s")[1].split("+")[0])
        blocks, first, last = layout[st]
        if kind == "FB" or first or last or not block.get(kind):  # the ends add embedding/head: not benchmarked
            continue
        fitted[kind] = fitted.get(kind, 0.0) + v
        benched[kind] = benched.get(kind, 0.0) + len(blocks) * block[kind]
    out = {k: fitted[k] / benched[k] for k in fitted}
    if fitted:
        out["all"] = sum(fitted.values()) / sum(benched.values())
    return out
