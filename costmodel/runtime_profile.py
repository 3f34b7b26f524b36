"""Calibration of this runtime on `local` for one config: micro-benchmarks plus a baseline run (costmodel.md §3).

calibrate_local_for(cfg) -> HardwareSpec `local` with a RuntimeProfile (hardware.py) for cfg's shape:
  1. micro-benchmarks in this process (1 thread, like a rank): one baseline Transformer block through the
     runtime's own code (DeferLinear + WeightGradStore for the I/W split, SavedTensors hooks) for F, B, I, W; and
     the residual wrapper the runtime runs (kernels.MHCSublayer pieces coefficients/apply_pre/apply_post_res on
     its CPU backend, F = identity) minus the plain residual x[:, 0] / x + y[:, None], forward, backward and the
     recompute rebuild, plus the stack ends expand/contract. All rounds interleave, so every piece sees the
     same background load.
  2. one measured BASELINE (n = 1) run of the config on its local gloo ranks (never an mHC run: an mHC trace is
     refused). Steady-state steps (the first is dropped): per-action medians and the mean concurrency k_base.
  3. fit: stretch_base = measured / micro-benchmarked time of the block-only stages' F, I, W, B; effective
     cores = k_base / stretch_base; intrinsic action time = measured median / stretch_base.
predict() then prices a baseline action as its intrinsic time (replay) and an mHC action as that plus
sub-layers x the micro-benchmarked wrapper cost, and stretches compute by max(1, k / effective_cores) with k
the simulated concurrency (fixed point).
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from costmodel.calibrate import calibrate_local

RUNTIME_KINDS = ("F", "I", "W", "B", "FB")


def runtime_key(cfg) -> dict:
    """What the per-action costs depend on: model shape, tokens per micro-batch, layout, recompute, dtype."""
    m, p = cfg.model, cfg.parallel
    return {"model": {"vocab_size": m.vocab_size, "num_blocks": m.num_blocks, "hidden": m.hidden,
                      "num_heads": m.num_heads, "head_dim": m.head_dim, "mlp_hidden": m.mlp_hidden,
                      "moe": None if m.moe is None else m.moe.model_dump()},
            "tokens_per_microbatch": p.tokens_per_microbatch, "seq_len": p.seq_len, "schedule": p.schedule,
            "ranks": p.ranks, "recompute": cfg.recompute.model_dump(), "dtype": cfg.train.dtype}


def residual_key(variant: str, n: int) -> str:
    return f"{variant}:{n}"


class _Rounds:
    """Interleaved timing: every round runs each named piece once; medians at the end."""

    def __init__(self):
        self.times: dict[str, list[float]] = {}

    def add(self, name: str, seconds: float) -> None:
        self.times.setdefault(name, []).append(seconds * 1e6)

    def medians(self, skip: int) -> dict[str, float]:
        return {k: statistics.median(v[skip:] if len(v) > skip else v) for k, v in self.times.items()}


def bench_runtime_pieces(cfg, variants: list[tuple[str, int]], rounds: int = 40, warmup: int = 5,
                         threads: int = 1) -> dict:
    """Micro-benchmark (us, one process): {"block": {F, B, I, W} of one baseline block,
    "residual": {"variant:n": {fwd, bwd, rc, expand_fwd, expand_bwd, contract_fwd, contract_bwd}}} where the
    residual entries are extra cost over the plain residual, per sub-layer (or per stack end)."""
    import torch

    from kernels import MHCSublayer, contract, expand
    from pipeline.memory import SavedTensors
    from pipeline.model import activation_dtype, build_block
    from pipeline.weight_grad import WeightGradStore

    torch.set_num_threads(threads)
    dt = activation_dtype(cfg.train.dtype)
    T, C = cfg.parallel.tokens_per_microbatch, cfg.model.hidden
    base_cfg = cfg.with_residual("residual", 1)
    store = WeightGradStore()
    block = build_block(base_cfg.model, cfg.parallel.seq_len, min(1, cfg.model.num_blocks - 1), cfg.train.seed,
                        store).to(dtype=dt) if dt != torch.float32 else \
        build_block(base_cfg.model, cfg.parallel.seq_len, min(1, cfg.model.num_blocks - 1), cfg.train.seed, store)
    saved = SavedTensors(block.parameters())
    x1 = torch.randn(T, 1, C, dtype=dt)
    g1 = torch.randn(T, 1, C, dtype=dt)
    R = _Rounds()
    clock = time.perf_counter

    def block_fwd(leaf):
        with saved.hooks():
            y = leaf
            for _, sub in block.sublayers():
                y = sub(y)
        return y

    def round_block():
        leaf = x1.detach().requires_grad_(True)
        t0 = clock()
        y = block_fwd(leaf)
        R.add("block.F", clock() - t0)
        t0 = clock()
        torch.autograd.backward(y, g1)
        R.add("block.B", clock() - t0)
        leaf = x1.detach().requires_grad_(True)
        y = block_fwd(leaf)
        store.enabled = True
        t0 = clock()
        torch.autograd.backward(y, g1)
        store.flush("bench")
        R.add("block.I", clock() - t0)
        store.enabled = False
        t0 = clock()
        store.pop()
        R.add("block.W", clock() - t0)
        block.zero_grad(set_to_none=True)

    def make_residual(variant: str, n: int):
        rc = cfg.model.residual.model_copy(update={"variant": variant, "n": n})
        mod = MHCSublayer(rc, torch.nn.Identity(), C)
        plain = variant == "residual"
        x = torch.randn(T, n, C, dtype=dt)
        g = torch.randn(T, n, C, dtype=dt)
        h = torch.randn(T, C, dtype=dt)
        gh = torch.randn(T, C, dtype=dt)
        tag = residual_key(variant, n)

        def wrapper(leaf):  # what pipeline.stage.Stage._sublayer runs around F (F = identity here)
            with saved.hooks():
                if plain:
                    u = leaf[:, 0]
                    return leaf + u[:, None], None, u
                c = mod.coefficients(leaf)
                u = mod.apply_pre(leaf, c)
                return mod.apply_post_res(leaf, u, c), c, u

        def one_round():
            leaf = x.detach().requires_grad_(True)
            t0 = clock()
            out, c, u = wrapper(leaf)
            R.add(f"{tag}.fwd", clock() - t0)
            t0 = clock()
            torch.autograd.backward(out, g)
            R.add(f"{tag}.bwd", clock() - t0)
            with torch.no_grad():  # recompute rebuild: pre and post+res from stored coefficients and F output
                y = u.detach()
                kc = None if c is None else type(c)(*(t.detach() for t in c))
                t0 = clock()
                if plain:
                    x[:, 0], x + y[:, None]
                else:
                    mod.apply_pre(x, kc), mod.apply_post_res(x, y, kc)
                R.add(f"{tag}.rc", clock() - t0)
            hl = h.detach().requires_grad_(True)
            t0 = clock()
            with saved.hooks():
                x0 = expand(hl, n)
            R.add(f"{tag}.expand_fwd", clock() - t0)
            t0 = clock()
            torch.autograd.backward(x0, g)
            R.add(f"{tag}.expand_bwd", clock() - t0)
            xl = x.detach().requires_grad_(True)
            t0 = clock()
            with saved.hooks():
                hc = contract(xl)
            R.add(f"{tag}.contract_fwd", clock() - t0)
            t0 = clock()
            torch.autograd.backward(hc, gh)
            R.add(f"{tag}.contract_bwd", clock() - t0)
            mod.zero_grad(set_to_none=True)

        return one_round

    wanted = [(v, n) for v, n in variants if not (v == "residual" or n == 1)]
    pieces = [round_block, make_residual("residual", 1)] + [make_residual(v, n) for v, n in wanted]
    for _ in range(warmup + rounds):
        for fn in pieces:
            fn()
    med = R.medians(warmup)
    out = {"block": {k: med[f"block.{k}"] for k in ("F", "B", "I", "W")}, "residual": {}}
    base = residual_key("residual", 1)
    for v, n in wanted:
        tag = residual_key(v, n)
        out["residual"][tag] = {p: max(0.0, med[f"{tag}.{p}"] - med[f"{base}.{p}"])
                                for p in ("fwd", "bwd", "rc", "expand_fwd", "expand_bwd", "contract_fwd",
                                          "contract_bwd")}
    out["raw_us"] = med
    return out


def _nested_in_fb(spans) -> set[int]:
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


def _check_baseline_trace(trace) -> None:
    res = trace.meta.get("residual")
    if isinstance(res, dict):
        variant, n = res.get("variant"), res.get("n")
        if variant not in (None, "residual") or n not in (None, 1):
            raise ValueError(f"calibration needs a baseline (n = 1, plain residual) run, got a trace of "
                             f"{variant} n={n}: the mHC run is the test, never an input (costmodel.md §3)")


def baseline_action_stats(trace, skip_steps: int = 1) -> tuple[dict[str, float], float, int]:
    """From a measured baseline trace: (median duration per action key 'F/s3' / 'FB/s3+s4', median concurrency
    = summed per-rank busy time / makespan per step, steps used). The first `skip_steps` steps are dropped."""
    from traces.compare import step_index
    from traces.trace import union_length

    _check_baseline_trace(trace)
    spans = trace.spans
    steps = step_index(trace)
    nsteps = 1 + max(steps.values(), default=-1)
    skip = skip_steps if nsteps > skip_steps else 0
    halves = _nested_in_fb(spans)
    durs: dict[str, list[float]] = {}
    per_step: dict[int, list] = {}
    for i, k in steps.items():
        if k < skip:
            continue
        s = spans[i]
        per_step.setdefault(k, []).append(s)
        if s.kind not in RUNTIME_KINDS or i in halves:
            continue
        durs.setdefault(_action_key(s), []).append(s.duration)
    conc = []
    for k, ss in per_step.items():
        mk = max(s.end for s in ss) - min(s.start for s in ss)
        busy: dict[int, list] = {}
        for s in ss:
            if s.kind in RUNTIME_KINDS:
                busy.setdefault(s.rank, []).append((s.start, s.end))
        if mk > 0:
            conc.append(sum(union_length(v) for v in busy.values()) / mk)
    if not durs:
        raise ValueError("the baseline trace has no F/I/W/B/FB spans named as in traces.md §5")
    return ({k: statistics.median(v) for k, v in durs.items()}, statistics.median(conc) if conc else 0.0,
            len(per_step))


def _action_key(s) -> str:
    return f"{s.kind}/s{s.stage}" + (f"+s{s.partner[0]}" if s.kind == "FB" and s.partner else "")


def _steady_actions(trace, skip_steps: int):
    from traces.compare import step_index

    steps = step_index(trace)
    nsteps = 1 + max(steps.values(), default=-1)
    skip = skip_steps if nsteps > skip_steps else 0
    halves = _nested_in_fb(trace.spans)
    for i, k in steps.items():
        if k >= skip and trace.spans[i].kind in RUNTIME_KINDS and i not in halves:
            yield trace.spans[i]


def baseline_gaps_and_makespan(trace, skip_steps: int = 1) -> tuple[float, float]:
    """(median gap before a compute action that waited for no receive, on its rank's own clock; median step
    makespan as traces.compare measures it), over the steady-state steps."""
    from traces.compare import step_index

    spans = trace.spans
    steps = step_index(trace)
    nsteps = 1 + max(steps.values(), default=-1)
    skip = skip_steps if nsteps > skip_steps else 0
    halves = _nested_in_fb(spans)
    by: dict[tuple[int, int], list] = {}
    per_step: dict[int, list] = {}
    for i, k in steps.items():
        if k < skip:
            continue
        s = spans[i]
        per_step.setdefault(k, []).append(s)
        if s.kind in RUNTIME_KINDS and i in halves:
            continue
        by.setdefault((k, s.rank), []).append(s)
    gaps = []
    for lst in by.values():
        comp = sorted((s for s in lst if s.kind in RUNTIME_KINDS), key=lambda s: s.start)
        recv_ends = [s.end for s in lst if s.kind.startswith("RECV")]
        for a, b in zip(comp, comp[1:]):
            if not any(a.end < e <= b.start for e in recv_ends):
                gaps.append(max(0.0, b.start - a.end))
    mks = [max(s.end for s in ss) - min(s.start for s in ss) for ss in per_step.values()]
    return (statistics.median(gaps) if gaps else 0.0), (statistics.median(mks) if mks else 0.0)


def fit_p2p_latency(cfg, hw, target_us: float, iters: int = 40) -> float:
    """Effective P2P latency (us) at which the simulated baseline step equals `target_us` (bisection; 0 when
    the simulation is already at least as long)."""
    from costmodel.mhc_cost import ResidualSpec
    from costmodel.predict import Options, Pricer, resolve_layout
    from schedules.build import build

    base = cfg.with_residual("residual", 1)
    sched = build(cfg.parallel.schedule, cfg.parallel.ranks, cfg.parallel.microbatches)
    layout = resolve_layout(base, sched, True)

    def makespan(alpha: float) -> float:
        prof = hw.runtime.model_copy(update={"p2p_latency_us": alpha})
        h = hw.model_copy(update={"runtime": prof})
        pr = Pricer(base, h, ResidualSpec.baseline(), layout, Options())
        pr.pinned_slowdown = hw.runtime.stretch_base  # the measured contention of the run being matched
        return pr.simulate(sched).makespan

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


def fit_runtime_profile(trace, cfg, bench: dict, host_cores: int | None, skip_steps: int = 1):
    """RuntimeProfile from a measured baseline trace and `bench_runtime_pieces` output (see hardware.py)."""
    from costmodel.hardware import RuntimeProfile
    from pipeline.config import stage_blocks
    from schedules.build import build

    med, k_base, used = baseline_action_stats(trace, skip_steps)
    sched = build(cfg.parallel.schedule, cfg.parallel.ranks, cfg.parallel.microbatches)
    nb = cfg.model.num_blocks
    blocks, inner = {}, set()
    for chain in sched.pipelines:
        for pos, (st, rng) in enumerate(zip(chain, stage_blocks(nb, len(chain)))):
            blocks[st] = len(rng)
            if 0 < pos < len(chain) - 1:
                inner.add(st)
    meas = pred = 0.0
    for key, v in med.items():
        kind, st = key.split("/")[0], int(key.split("/s")[1].split("+")[0])
        if kind == "FB" or (inner and st not in inner):
            continue
        meas += v
        pred += blocks.get(st, 1) * bench["block"][kind]
    stretch = meas / pred if pred > 0 else 1.0
    cores = float(host_cores or 1)
    if stretch > 1.0 and k_base > 0:
        eff = k_base / stretch
    else:  # no contention seen: the ranks had at least what they used
        eff = max(cores, k_base, 1e-3)
    gap, mk = baseline_gaps_and_makespan(trace, skip_steps)
    if mk > 0:
        # concurrency as the simulation counts it: every action at its median plus the executor's gap before it
        # (CPU work too), per step, over the measured step; robust to the rare stalls that inflate a mean
        work = sum(med[_action_key(s)] + gap for s in _steady_actions(trace, skip_steps)) / max(used, 1)
        k_base = work / mk
        eff = k_base / stretch if stretch > 1.0 else max(cores, k_base, 1e-3)
    s_b = max(1.0, k_base / eff)
    return RuntimeProfile(action_overhead_us=gap / s_b,
        key=runtime_key(cfg), action_us={k: v / s_b for k, v in med.items()}, residual_us=bench.get("residual", {}),
        effective_cores=eff, stretch_base=s_b, concurrency_base=k_base,
        meta={"measured_median_us": med, "block_bench_us": bench["block"], "stretch_measured": stretch,
              "steps_used": used, "host_cores": host_cores, "source": trace.meta.get("source"),
              "bench_raw_us": bench.get("raw_us", {})})


def _run_worker(rank: int, world: int, cfg_dict: dict, trace_dir: str):
    import torch

    from pipeline.config import parse_config
    from pipeline.train import train

    hist = train(parse_config(cfg_dict), rank, world, torch.device("cpu"), trace_dir=Path(trace_dir),
                 log=lambda *a: None)
    return [h.step_time_s for h in hist]


def run_runtime(cfg, trace_dir: str | Path, steps: int | None = None, timeout_s: float = 300.0):
    """Run cfg on its local gloo ranks (pipeline.local.launch + pipeline.train.train) and load the measured trace.
    Returns (Trace, per-step step times in seconds as the runtime reports them)."""
    from pipeline.local import launch
    from traces.trace import Trace

    data = cfg.model_dump()
    if steps is not None:
        data["train"]["steps"] = steps
    data["train"]["device"] = "cpu"
    trace_dir = Path(trace_dir)
    trace_dir.mkdir(parents=True, exist_ok=True)
    res = launch(_run_worker, cfg.parallel.ranks, (data, str(trace_dir)), timeout_s=timeout_s)
    bad = [r for r in res if r.exitcode != 0]
    if bad:
        raise RuntimeError(f"runtime run failed: {bad[0].error or f'rank {bad[0].rank} exit {bad[0].exitcode}'}")
    return Trace.load(trace_dir / "trace.json"), res[0].value


def calibrate_local_for(cfg, *, hardware=None, baseline_trace=None, steps: int = 4, variants=None,
                        rounds: int = 40, work_dir: str | Path | None = None, quick: bool = True,
                        timeout_s: float = 300.0):
    """`local` HardwareSpec for `cfg`: host micro-benchmarks (calibrate_local unless `hardware` is given), the
    runtime micro-benchmarks and a measured BASELINE run of cfg (run here unless `baseline_trace` is given).
    variants: [(variant, n)] residuals to price (default: cfg's own)."""
    from costmodel.hardware import HardwareSpec, get_hardware

    hw = hardware if isinstance(hardware, HardwareSpec) else (
        get_hardware(hardware) if hardware is not None else calibrate_local(quick=quick))
    r = cfg.model.residual
    variants = list(variants) if variants is not None else [(r.variant, r.n)]
    base_cfg = cfg.with_residual("residual", 1)
    bench = bench_runtime_pieces(cfg, variants, rounds=rounds)
    if baseline_trace is None:
        tmp = tempfile.mkdtemp(prefix="cal_base_") if work_dir is None else str(work_dir)
        baseline_trace, _ = run_runtime(base_cfg, tmp, steps, timeout_s)
    profile = fit_runtime_profile(baseline_trace, cfg, bench, hw.host_cores or os.cpu_count())
    hw = hw.model_copy(update={"runtime": profile})
    _, target = baseline_gaps_and_makespan(baseline_trace)
    alpha = fit_p2p_latency(cfg, hw, target)
    profile = profile.model_copy(update={"p2p_latency_us": alpha,
                                         "meta": profile.meta | {"baseline_makespan_us": target}})
    return hw.model_copy(update={"runtime": profile})
