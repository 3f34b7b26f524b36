"""Fit this runtime's `local` RuntimeProfile on a measured BASELINE run (costmodel.md §3).

Model (costmodel.shared_cores): every compute action is full-speed *work*; the ranks computing at a moment share
the host's cores at rate(k) = min(1, cores(k) / k) with cores(k) measured (core_sharing.py); the executor
spends full-speed work `gap` before each action; a stage-boundary message takes alpha + bytes / bandwidth.

The fit, on the steady-state steps of the baseline trace (the first step is dropped):
* work per action key ('F/s3', 'FB/s3+s4'): the median measured duration. Baseline actions (~1 ms) are short
  against the scheduler's time slice, so most run unpreempted at full speed and the median is their work; the
  preempted ones make the mean, which the shared-cores simulation reproduces by itself;
* gap: the median measured gap between two compute actions that waited for no receive;
* insitu_over_bench (meta, a diagnostic): the block-only stages' work over the same blocks micro-benchmarked
  in one process. It is not applied to the wrapper's micro-benchmark: actions that run alone in the pipeline (the
  first forwards of a step, the last backwards) take what the micro-benchmarks say, so the excess comes from
  running among other ranks, which is what the shared-cores simulation prices;
* alpha: the value at which the simulated baseline step equals the measured median step (bisection), which
  takes up what the model does not have (gloo progress, waking a descheduled receiver).
The mHC run is never an input: a trace of another residual is refused.
"""
from __future__ import annotations

import statistics

RUNTIME_KINDS = ("F", "I", "W", "B", "FB")
STALL_FACTOR = 5.0  # a duration above this many medians of its key is a stall (page faults, VM steal), not sharing


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


def check_baseline_trace(trace) -> None:
    res = trace.meta.get("residual")
    if isinstance(res, dict):
        variant, n = res.get("variant"), res.get("n")
        if variant not in (None, "residual") or n not in (None, 1):
            raise ValueError(f"calibration needs a baseline (n = 1, plain residual) run, got a trace of "
                             f"{variant} n={n}: the mHC run is the test, never an input (costmodel.md §3)")


def steady_steps(trace, skip_steps: int = 1) -> dict[int, list[int]]:
    """step -> indices of its schedule spans, without the first `skip_steps` steps (all when that leaves none)."""
    from traces.compare import step_index

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
    as traces.compare measures it), over the steady-state steps."""
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
    from costmodel.mhc_cost import ResidualSpec
    from costmodel.predict import Options, Pricer, resolve_layout
    from schedules.build import build

    base = cfg.with_residual("residual", 1)
    sched = build(cfg.parallel.schedule, cfg.parallel.ranks, cfg.parallel.microbatches)
    return Pricer(base, hw, ResidualSpec.baseline(), resolve_layout(base, sched, True), Options()), sched


def fit_p2p_latency(cfg, hw, target_us: float, iters: int = 40) -> float:
    """Effective P2P latency (us) at which the simulated baseline step equals `target_us` (0 when the simulation
    is already at least as long)."""
    def makespan(alpha: float) -> float:
        h = hw.model_copy(update={"runtime": hw.runtime.model_copy(update={"p2p_latency_us": alpha})})
        pricer, sched = _baseline_pricer(cfg, h)
        return pricer.simulate(sched).makespan

    lo, hi = 0.0, max(target_us, 1.0)
    if makespan(lo) >= target_us:
        return 0.0
    while makespan(hi) < target_us:
        hi *= 2
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if makespan(mid) < target_us else (lo, mid)
        if hi - lo < 1.0:
            break
    return 0.5 * (lo + hi)


def fit_runtime_profile(trace, cfg, bench: dict, cores: list[float], hw_base, skip_steps: int = 1):
    """RuntimeProfile from a measured baseline trace, `bench_runtime_pieces` output and cores(k) (see above).
    `hw_base`: the host's HardwareSpec (its link prices the message bytes)."""
    from costmodel.hardware import RuntimeProfile
    from costmodel.runtime_profile import runtime_key

    means, medians, used = baseline_action_stats(trace, skip_steps)
    gap, makespan = gaps_and_makespan(trace, skip_steps)
    profile = RuntimeProfile(key=runtime_key(cfg), action_us=dict(medians), residual_us=bench.get("residual", {}),
                             action_overhead_us=gap, cores_by_concurrency=list(cores))
    alpha = fit_p2p_latency(cfg, hw_base.model_copy(update={"runtime": profile}), makespan)
    return profile.model_copy(update={"p2p_latency_us": alpha, "meta": {
        "measured_mean_us": means, "measured_median_us": medians, "block_bench_us": bench.get("block", {}),
        "bench_raw_us": bench.get("raw_us", {}), "insitu_over_bench": insitu_factor(medians, cfg, bench),
        "steps_used": used, "baseline_makespan_us": makespan,
        "source": trace.meta.get("source")}})


def insitu_factor(work: dict[str, float], cfg, bench: dict) -> float | None:
    """Fitted full-speed work of the block-only stages' F, I, W, B over the same blocks micro-benchmarked in one
    process: how much slower the code runs inside the pipeline (executor, hooks, caches shared with other ranks)."""
    from costmodel.predict import resolve_layout
    from schedules.build import build

    block = bench.get("block")
    if not block:
        return None
    sched = build(cfg.parallel.schedule, cfg.parallel.ranks, cfg.parallel.microbatches)
    layout = resolve_layout(cfg, sched, True)  # stage -> (blocks, first of its pipeline, last)
    fitted = benched = 0.0
    for key, v in work.items():
        kind, st = key.split("/")[0], int(key.split("/s")[1].split("+")[0])
        blocks, first, last = layout[st]
        if kind == "FB" or first or last or kind not in block:  # the ends add embedding/head: not benchmarked
            continue
        fitted += v
        benched += len(blocks) * block[kind]
    return fitted / benched if benched > 0 else None
