"""Calibration of this runtime on `local` for one config: micro-benchmarks plus a baseline run (costmodel.md §3).

calibrate_local_for(cfg) -> HardwareSpec `local` with a RuntimeProfile (hardware.py) for cfg's shape:
  1. micro-benchmarks in this process (1 thread, like a rank): one baseline Transformer block through the
     runtime's own code (DeferLinear + WeightGradStore for the I/W split, SavedTensors hooks) for F, B, I, W; and
     the residual wrapper the runtime runs (kernels.MHCSublayer pieces coefficients/apply_pre/apply_post_res on
     its CPU backend, F = identity) minus the plain residual x[:, 0] / x + y[:, None], forward, backward and the
     recompute rebuild, plus the stack ends expand/contract. All rounds interleave, so every piece sees the
     same background load.
  2. cores(k): how k concurrent single-thread ranks share this host (core_sharing.py), k = 1 .. ranks.
  3. one measured BASELINE (n = 1) run of the config on its local gloo ranks (never an mHC run: an mHC trace is
     refused), fitted by runtime_fit: full-speed work per action, executor gap, effective P2P latency.
predict() then prices a baseline action as its fitted work (replay) and an mHC action as that plus sub-layers x
the micro-benchmarked wrapper cost, and simulates them on ranks sharing the host's cores (shared_cores.py).
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from costmodel.calibrate import calibrate_local

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
                        timeout_s: float = 300.0, cores: list[float] | None = None):
    """`local` HardwareSpec for `cfg`: host micro-benchmarks (calibrate_local unless `hardware` is given), the
    runtime micro-benchmarks, cores(k) for k up to the config's ranks (measured unless `cores` is given) and a
    measured BASELINE run of cfg (run here unless `baseline_trace` is given), fitted by runtime_fit.
    variants: [(variant, n)] residuals to price (default: cfg's own)."""
    from costmodel.core_sharing import measure_core_sharing
    from costmodel.hardware import HardwareSpec, get_hardware
    from costmodel.runtime_fit import fit_runtime_profile

    hw = hardware if isinstance(hardware, HardwareSpec) else (
        get_hardware(hardware) if hardware is not None else calibrate_local(quick=quick))
    hw = hw.model_copy(update={"runtime": None})
    r = cfg.model.residual
    variants = list(variants) if variants is not None else [(r.variant, r.n)]
    base_cfg = cfg.with_residual("residual", 1)
    bench = bench_runtime_pieces(cfg, variants, rounds=rounds)
    if cores is None:
        cores = measure_core_sharing(cfg, cfg.parallel.ranks, seconds=1.0 if quick else 2.0)
    if baseline_trace is None:
        tmp = tempfile.mkdtemp(prefix="cal_base_") if work_dir is None else str(work_dir)
        baseline_trace, _ = run_runtime(base_cfg, tmp, steps, timeout_s)
    profile = fit_runtime_profile(baseline_trace, cfg, bench, cores, hw)
    return hw.model_copy(update={"runtime": profile})
