"""Timings of this runtime on the host, for the `local` calibration (costmodel.local): plain data in, plain data
out, so the cost model never imports the runtime; the app layer (mhcpipe.demo, bench/) hands the results over.

Shape letters: T tokens of a micro-batch, n streams, C hidden.

time_stage_pieces(cfg, variants) times, in this process with one thread (like a rank):
* one middle pipeline stage holding one Transformer block, through pipeline.runtime.stage.Stage exactly as a rank runs
it (forward generator, split backward I with the WeightGradStore, its W, and the full backward B), once with the
  plain residual and once per residual variant. The variant's extra cost per sub-layer is the difference over
  the block's two sub-layers. Timing the whole stage rather than the residual wrapper alone keeps what the
  wrapper does to the code around it: an mHC block's weight-grad GEMMs run slower than the baseline's after
  the wrapper's backward has pushed their operands out of cache, although the GEMMs are the same.
* the pieces a middle stage does not have: the recompute rebuild (pre and post+res from stored coefficients)
  and the stack ends expand/contract, on the variant's MLP-side wrapper (pipeline.model.wrap_sublayer) with
  F = identity.
Every timed piece starts from an evicted cache: in the pipeline the ranks time-share the cores, so an action
rarely finds its operands where the previous action of its own rank left them. All pieces interleave round by
round, so every one of them sees the same background load; the result is the median over rounds.

block_round(cfg_dict) is the work costmodel.local.core_sharing runs in k processes at once to measure how they
share the cores: forward and backward of one Transformer block of the config's shape.

run_runtime(cfg, trace_dir) / run_runtime_interleaved(cfgs, trace_dirs) run configs on local gloo ranks and
load the measured traces (the baseline run a `local` calibration is fitted on).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the type of every `cfg` here; configs is imported where it is used
    from configs import RunConfig

import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from configs import parse_config
from kernels import contract, expand, single_pass
from traces.trace import Trace

from pipeline.launch.local import interleaved_worker, launch
from pipeline.model import activation_dtype, build_block, wrap_sublayer
from pipeline.partition import StageSpec
from pipeline.observability.recorder import Recorder
from pipeline.runtime.saved_tensors import SavedTensors
from pipeline.runtime.stage import ChunkRun, Stage, StageEnv
from pipeline.weight_grad import WeightGradStore

EVICT_BYTES = 8 << 20  # more than one core's L2 on current server CPUs (1-2 MiB)
# pieces timed outside a middle stage, each the variant's extra over the plain residual's
END_PIECES = ("rc", "expand_fwd", "expand_bwd", "contract_fwd", "contract_bwd")


def residual_key(variant: str, n: int) -> str:
    return f"{variant}:{n}"


class _Rounds:
    """Interleaved timing: every round runs each piece once; medians at the end."""

    def __init__(self):
        self.times: dict[str, list[float]] = {}
        self.clock = time.perf_counter

    def add(self, name: str, seconds: float) -> None:
        self.times.setdefault(name, []).append(seconds * 1e6)

    def medians(self, skip: int) -> dict[str, float]:
        return {k: statistics.median(v[skip:] if len(v) > skip else v) for k, v in self.times.items()}


def _stage_round(cfg: RunConfig, R: _Rounds, tag: str, evict):
    """One round of F, I (+ flush), W and F, B of a one-block middle stage of `cfg`'s residual."""
    dt = activation_dtype(cfg.train.dtype)
    T, C, n = cfg.parallel.tokens_per_microbatch, cfg.model.hidden, cfg.model.residual.n
    block = min(1, cfg.model.num_blocks - 1)
    store = WeightGradStore()
    spec = StageSpec(stage=1, rank=0, pipeline=0, chunk=1, blocks=range(block, block + 1), prev=0, next=2)
    stage = Stage(spec, cfg, store=store, dtype=dt, rc_block=None).to(dtype=dt)
    env = StageEnv(SavedTensors(stage.parameters()), Recorder(0, torch.device("cpu"), enabled=True), T)
    x, g = torch.randn(T, n, C, dtype=dt), torch.randn(T, n, C, dtype=dt)
    if cfg.model.residual.variant == "mhc-sp":  # a middle stage receives the state packed with its coefficient
        a = torch.sigmoid(torch.randn(T, n))
        x, g = single_pass.pack_state(x, a), single_pass.pack_state(g, torch.randn(T, n))
    clock = R.clock

    def forward() -> ChunkRun:
        run = ChunkRun(1, 0)
        evict()
        t0 = clock()
        for _ in stage.forward_steps(run, x, None, env):
            pass
        R.add(f"{tag}.F", clock() - t0)
        return run

    def one_round():
        run = forward()
        evict()
        t0 = clock()
        store.enabled = True
        for _ in stage.backward_steps(run, g, env):
            pass
        store.flush((1, 0))
        store.enabled = False
        R.add(f"{tag}.I", clock() - t0)
        evict()
        t0 = clock()
        store.pop()
        R.add(f"{tag}.W", clock() - t0)
        run = forward()
        evict()
        t0 = clock()
        for _ in stage.backward_steps(run, g, env):
            pass
        R.add(f"{tag}.B", clock() - t0)
        stage.zero_grad(set_to_none=True)
        env.recorder.spans.clear()

    return one_round


def _ends_round(cfg: RunConfig, R: _Rounds, tag: str, evict):
    """One round of the recompute rebuild and the stack ends of `cfg`'s residual on its CPU backend."""
    dt = activation_dtype(cfg.train.dtype)
    T, C, n = cfg.parallel.tokens_per_microbatch, cfg.model.hidden, cfg.model.residual.n
    res = cfg.model.residual
    plain = res.variant == "residual"
    # the MLP sub-layer's residual (xHC augments its write-back) around F = identity
    mod = wrap_sublayer(res, torch.nn.Identity(), C, 1, cfg.parallel.seq_len, mlp=True)
    x, g = torch.randn(T, n, C, dtype=dt), torch.randn(T, n, C, dtype=dt)
    h, gh = torch.randn(T, C, dtype=dt), torch.randn(T, C, dtype=dt)
    a = torch.sigmoid(torch.randn(T, n)) if res.variant == "mhc-sp" else None  # mhc-sp's carried coefficient
    routing = None  # xHC-Flash: the MLP reuses its block's attention routing
    if res.variant == "xhc" and res.flash:
        with torch.no_grad():
            routing = wrap_sublayer(res, torch.nn.Identity(), C, 0, cfg.parallel.seq_len, mlp=False).coefficients(x)
    clock = R.clock
    end = contract if a is None else (lambda t: single_pass.contract(t, a))

    def one_round():
        with torch.no_grad():  # what pipeline.runtime.stage's recompute step runs from stored coefficients and F output
            c = None if plain else mod.coefficients(x, routing) if routing is not None else mod.coefficients(x)
            y = x[:, 0] if plain else mod.apply_pre(x, c if a is None else a)
            evict()
            t0 = clock()
            if plain:
                x[:, 0], x + y[:, None]
            else:
                mod.apply_pre(x, c if a is None else a), mod.apply_post_res(x, y, c)
            R.add(f"{tag}.rc", clock() - t0)
        for name, fn, inp, grad in (("expand", lambda t: expand(t, n), h, g), ("contract", end, x, gh)):
            leaf = inp.detach().requires_grad_(True)
            evict()
            t0 = clock()
            out = fn(leaf)
            R.add(f"{tag}.{name}_fwd", clock() - t0)
            evict()
            t0 = clock()
            torch.autograd.backward(out, grad)
            R.add(f"{tag}.{name}_bwd", clock() - t0)
        mod.zero_grad(set_to_none=True)

    return one_round


def time_stage_pieces(cfg: RunConfig, variants: list[tuple[str, int]], rounds: int = 40, warmup: int = 5,
                      threads: int = 1) -> dict:
    """Micro-benchmark (us, one process), see the module docstring. Returns
    {"block": {F, I, W, B} of one baseline block in a middle stage,
     "residual": {"variant:n": {fwd, bwd, w, b, rc, expand_fwd, expand_bwd, contract_fwd, contract_bwd}}}
    where fwd/bwd/w/b are the variant's extra F/I/W/B cost per sub-layer over the plain residual, and rc and the
    stack ends the extra cost of those pieces; "raw_us" has every median."""
    torch.set_num_threads(threads)
    evict_buf = torch.zeros(EVICT_BYTES // 4)

    def evict() -> None:
        evict_buf.add_(1.0)

    base_cfg = cfg.with_residual("residual", 1)
    wanted = [(v, n) for v, n in variants if not (v == "residual" or n == 1)]
    R = _Rounds()
    pieces = []
    own = (cfg.model.residual.variant, cfg.model.residual.n)
    for v, n in [("residual", 1)] + wanted:
        # the config's own residual keeps its settings (xHC's k, flash, augmentation)
        c = base_cfg if v == "residual" else cfg if (v, n) == own else cfg.with_residual(v, n)
        pieces += [_stage_round(c, R, residual_key(v, n), evict), _ends_round(c, R, residual_key(v, n), evict)]
    for _ in range(warmup + rounds):
        for fn in pieces:
            fn()
    med = R.medians(warmup)
    base = residual_key("residual", 1)
    out = {"block": {k: med[f"{base}.{k}"] for k in ("F", "I", "W", "B")}, "residual": {}}
    for v, n in wanted:
        tag = residual_key(v, n)
        extra = {p: max(0.0, (med[f"{tag}.{k}"] - med[f"{base}.{k}"]) / 2)  # the block's two sub-layers
                 for p, k in (("fwd", "F"), ("bwd", "I"), ("w", "W"), ("b", "B"))}
        extra.update({p: max(0.0, med[f"{tag}.{p}"] - med[f"{base}.{p}"]) for p in END_PIECES})
        out["residual"][tag] = extra
    out["raw_us"] = med
    return out


def block_round(cfg_dict: dict) -> Callable[[], None]:
    """One forward + backward of block 0 of the config's shape with the plain residual, as a callable (built
    once; called repeatedly by the core-sharing measurement in each of its processes)."""
    cfg = parse_config(cfg_dict).with_residual("residual", 1)
    T, C = cfg.parallel.tokens_per_microbatch, cfg.model.hidden
    block = build_block(cfg.model, cfg.parallel.seq_len, 0, cfg.train.seed, WeightGradStore())
    x = torch.randn(T, 1, C)
    g = torch.randn(T, 1, C)

    def one_round() -> None:
        y = x.detach().requires_grad_(True)
        for _, sub in block.sublayers():
            y = sub(y)
        torch.autograd.backward(y, g)
        block.zero_grad(set_to_none=True)

    return one_round


def run_runtime_interleaved(cfgs: list, trace_dirs: list[str | Path], steps: int | None = None,
                            timeout_s: float = 300.0):
    """Run several configs in one launch on their local gloo ranks, one step of each in turn
    (pipeline.launch.local.interleaved_worker): an A/B measurement in which every variant sees the same drift of a
    shared host's speed. Returns [(Trace, per-step step times in seconds)], one per config."""
    data = []
    for cfg in cfgs:
        d = cfg.model_dump()
        if steps is not None:
            d["train"]["steps"] = steps
        d["train"]["device"] = "cpu"
        data.append(d)
    dirs = [Path(t) for t in trace_dirs]
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    res = launch(interleaved_worker, cfgs[0].parallel.ranks, (data, [str(d) for d in dirs]), timeout_s=timeout_s)
    bad = [r for r in res if r.exitcode != 0]
    if bad:
        raise RuntimeError(f"runtime run failed: {bad[0].error or f'rank {bad[0].rank} exit {bad[0].exitcode}'}")
    return [(Trace.load(d / "trace.json"), [s["step_time_s"] for s in stats]) for d, stats in zip(dirs, res[0].value)]


def run_runtime(cfg: RunConfig, trace_dir: str | Path, steps: int | None = None, timeout_s: float = 300.0):
    """Run cfg on its local gloo ranks and load the measured trace (run_runtime_interleaved with one config).
    Returns (Trace, per-step step times in seconds as the runtime reports them)."""
    return run_runtime_interleaved([cfg], [trace_dir], steps, timeout_s)[0]
