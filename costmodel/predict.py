"""`predict(run_config, hardware)`: price every schedule action for the baseline (n = 1) and for mHC, simulate
both, and explain the difference.

Steps:
1. Build the schedule (schedules.build) and map stages to blocks: every pipeline chain splits the L_b blocks
   into consecutive stages (configs.stage_blocks); the chain's first stage adds the embedding (and the
   mHC expand), its last the head, loss (and the contract). Uneven splits are an error unless allowed.
2. Price each action as a small stream simulation of its kernels (overlap.py): per-op roofline with efficiency
   curves (hardware.py, ops.py), mHC kernels by bytes (mhc_cost.py), all-to-all by alpha-beta (comm.py).
   F, I, W, B and the overlapped F&B step are priced separately, per stage (stages differ at the ends).
3. Stage-boundary messages cost alpha + T n C d / (bw eta) on the PP link (comm.py).
4. Simulate (schedules.simulate): compute spans per rank, transfers on their own channel; exposed
   communication and bubbles come out of the simulation.
5. Attribute the overhead by a ladder of counterfactual simulations that adds one mechanism at a time:
   baseline -> + mHC kernels (no recompute, boundary at baseline width) -> + recompute -> + n-fold boundary
   traffic (the full mHC run). The steps sum exactly to the overhead. The change of the mean idle time per rank
   (bubble) is reported alongside; it is part of those steps, not an extra term.

`local` hardware calibrated for this runtime (a RuntimeProfile): actions are priced as full-speed work (fitted
baseline actions + the residual's micro-benchmarked extra of that kind) and simulated on ranks sharing the
host's cores in time slices (shared_cores.py). `local` without a profile (roofline): compute is stretched by
max(1, busy ranks / cores), the mean concurrency of a first simulation.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from costmodel import comm
from costmodel.hardware import HardwareSpec, get_hardware
from costmodel.memory import RankMemory, StageMemory, rank_memory, stage_memory
from costmodel.mhc_cost import ResidualSpec, recompute_kernel, residual_kernels, stack_ends
from costmodel.ops import Kernel, Shape, block_work, embedding, head
from costmodel.overlap import OverlapResult, TimedOp, overlap
from costmodel.shared_cores import simulate_shared
from configs import RunConfig, stage_blocks
from schedules.build import build
from schedules.ir import Action, Kind, Schedule
from schedules.simulate import SimResult, simulate


@dataclass(frozen=True)
class Options:
    """Modelling switches. fb_mode: how an F&B step is priced (overlap.MODES). hp_stream: MLP-side post+res on the
    high-priority stream. sigma: interference (None = the hardware's). pp_bandwidth: override of the PP link
    bandwidth in bytes/s (sweeps). allow_uneven: accept stages with different block counts (as the config's
    parallel.uneven_stages does)."""

    fb_mode: str = "streams"
    hp_stream: bool = True
    sigma: float | None = None
    pp_bandwidth: float | None = None
    allow_uneven: bool = False
    unit_costs: bool = False  # self-check (costmodel.md §2.6): F = I = W = 1, B = 2, F&B = 3, free P2P


def resolve_layout(cfg: RunConfig, schedule: Schedule, allow_uneven: bool) -> dict[int, tuple[range, bool, bool]]:
    """stage -> (blocks, is first of its pipeline, is last)."""
    out: dict[int, tuple[range, bool, bool]] = {}
    nb = cfg.model.num_blocks
    for chain in schedule.pipelines:
        S = len(chain)
        if nb < S:
            raise ValueError(f"{nb} blocks cannot fill {S} pipeline stages ({schedule.kind}, {schedule.num_ranks} "
                             "ranks); use fewer ranks")
        if nb % S and not (allow_uneven or cfg.parallel.uneven_stages):
            sizes = [len(r) for r in stage_blocks(nb, S)]
            divisors = [p for p in range(1, nb + 1) if nb % p == 0]
            raise ValueError(f"{nb} blocks do not divide evenly into {S} stages (would be {sizes}); choose a layout "
                             f"whose stage count divides {nb} (stages per pipeline: {divisors}) or allow uneven "
                             "stages (--uneven, or parallel.uneven_stages: true in the config)")
        for pos, (st, blocks) in enumerate(zip(chain, stage_blocks(nb, S))):
            out[st] = (blocks, pos == 0, pos == S - 1)
    return out


class Pricer:
    """Per-action durations for one residual variant."""

    def __init__(self, cfg: RunConfig, hw: HardwareSpec, spec: ResidualSpec, layout: dict, options: Options,
                 *, recompute: bool = True, boundary_width: int | None = None):
        self.cfg, self.hw, self.spec, self.layout, self.opt = cfg, hw, spec, layout, options
        self.shape = Shape.of(cfg)
        self.recompute = recompute
        self.width = spec.width if boundary_width is None else boundary_width
        self.sigma = hw.interference if options.sigma is None else options.sigma
        link = comm.pp_link(hw, cfg.parallel.ranks, cfg.parallel.expert_parallel)
        if options.pp_bandwidth is not None:
            link = link.with_bandwidth(options.pp_bandwidth)
        self.link = link
        self.slowdown = 1.0
        self.results: dict[tuple, OverlapResult] = {}
        self.stage_mem: dict[int, StageMemory] = {
            st: stage_memory(cfg, spec, st, blocks, first, last, recompute) for st, (blocks, first, last) in layout.items()}
        self.runtime = runtime_profile_for(hw, cfg)

    # ---- kernels -> timed ops ---------------------------------------------------------------------------
    def kernel_us(self, k: Kernel, backward: bool) -> float:
        hw = self.hw
        launch = (hw.backward_launch_us if backward else hw.launch_us) * k.launches
        if k.cls == "a2a":
            return comm.all_to_all_us(hw, self.shape.ep, k.nbytes)
        if k.cls == "matrix":
            return hw.matmul_us(k.flops, k.nbytes, k.dtype) + launch
        if k.cls == "vector":
            return hw.vector_us(k.flops, k.nbytes) + launch
        if k.cls == "memory":
            return hw.memory_us(k.nbytes) + launch
        return launch

    def _ops(self, kernels: list[Kernel], backward: bool) -> list[TimedOp]:
        return [TimedOp(k.name, k.group, k.stream, self.kernel_us(k, backward), k.deps, k.preemptible)
                for k in kernels]

    def _sublayers(self, stage: int):
        blocks, first, last = self.layout[stage]
        s, spec, hp = self.shape, self.spec, self.opt.hp_stream
        for b in blocks:
            for work in block_work(s, b):
                before, after, bwd = residual_kernels(spec, s.T, s.C, s.d, work.kind != "attn", hp)
                yield work, before, after, bwd

    def forward_kernels(self, stage: int) -> list[Kernel]:
        blocks, first, last = self.layout[stage]
        s = self.shape
        expand, contract = stack_ends(self.spec, s.T, s.C, s.d)
        out: list[Kernel] = []
        if first:
            out += embedding(s).F + expand
        for work, before, after, _ in self._sublayers(stage):
            out += before + work.F + after
        if last:
            out += contract + head(s).F
        return out

    def backward_ops(self, stage: int, with_w: bool, with_i: bool = True) -> list[TimedOp]:
        """The I chain (with_w=False), the W chain (with_i=False) or the full backward B (both)."""
        blocks, first, last = self.layout[stage]
        s, spec = self.shape, self.spec
        L = 2 * len(blocks)
        L_r = self.stage_mem[stage].recompute_block if self.recompute else None
        expand, contract = stack_ends(spec, s.T, s.C, s.d)
        subs = list(self._sublayers(stage))
        ops: list[TimedOp] = []
        last_i: list[int] = []  # index of the I chain's latest kernel: the gradient flows along that chain only

        def add(kernels: list[Kernel], anchor: int | None = None) -> None:
            timed = self._ops(kernels, backward=True)
            if anchor is not None:  # W kernels wait only for the sub-layer's first I kernel
                timed = [TimedOp(o.name, o.group, o.stream, o.duration, (anchor - len(ops) - j,) if anchor >= 0 else (),
                                 o.preemptible) for j, o in enumerate(timed)]
            elif timed:  # an I kernel waits for the previous I kernel, not for W kernels queued in between
                o = timed[0]
                assert o.deps == (-1,), f"{o.name}: a chain's first kernel depends on the previous one"
                timed[0] = TimedOp(o.name, o.group, o.stream, o.duration,
                                   (last_i[-1] - len(ops),) if last_i else (), o.preemptible)
                last_i.append(len(ops) + len(timed) - 1)
            ops.extend(timed)

        if last:
            h = head(s)
            if with_i:
                add(h.I + [kk.scaled(1.0) for kk in contract])
            if with_w:
                add(h.W, len(ops) - len(h.I) - len(contract) if with_i else -1)
        for idx in range(len(subs) - 1, -1, -1):
            work, before, after, bwd = subs[idx]
            if with_i and L_r and (idx == L - 1 or (idx + 1) % L_r == 0):
                rc = recompute_kernel(spec, s.T, s.C, s.d, idx - (idx // L_r) * L_r + 1)
                if rc is not None:  # entering a recompute block from its end: rebuild its mHC intermediates
                    add([rc])
            start = len(ops)
            if with_i:
                split = 0 if spec.is_baseline else len(after)
                add(bwd[:split] + work.I + bwd[split:])
            if with_w:
                add(work.W, start if with_i else -1)
        if first:
            e = embedding(s)
            if with_i:
                add(expand)
            if with_w:
                add(e.W, len(ops) - 1 if with_i and ops else -1)
        return ops

    # ---- schedule callbacks -----------------------------------------------------------------------------
    def _run(self, key: tuple, chains: list[list[TimedOp]], fb: bool) -> float:
        mode = self.opt.fb_mode if fb else ("serial" if self.opt.fb_mode == "serial" else "streams")
        res = overlap(chains, mode, self.sigma, self.opt.hp_stream)
        self.results[key] = res
        return res.makespan * self.slowdown

    # ---- `local` with a runtime profile: fitted baseline actions + the residual's micro-benchmarked extra ------
    def _residual_extra(self) -> dict[str, float] | None:
        if self.spec.is_baseline:
            return None
        key = f"{self.spec.variant}:{self.spec.n}"
        extra = self.runtime.residual_us.get(key)
        if extra is None:
            raise ValueError(f"hardware {self.hw.name!r}: its runtime profile has no micro-benchmark of residual "
                             f"{key} (has {', '.join(self.runtime.residual_us) or 'none'}); recalibrate with "
                             f"calibrate_local_for(cfg, variants=[('{self.spec.variant}', {self.spec.n})])")
        return extra

    def _base_action(self, key: str, kind: str, stage: int) -> float:
        table = self.runtime.action_us
        if key in table:
            return table[key]
        same = [v for k, v in table.items() if k.startswith(kind + "/")]
        if same:
            return statistics.median(same)
        raise ValueError(f"runtime profile has no {kind} actions; recalibrate `local` for this schedule")

    def _extra_us(self, stage: int, kind: str) -> float:
        """The residual's extra full-speed work in one F, I, W or B action of `stage` over the baseline's."""
        extra = self._residual_extra()
        if extra is None:
            return 0.0
        blocks, first, last = self.layout[stage]
        subs = 2 * len(blocks)
        if kind == "F":
            return subs * extra["fwd"] + (extra["expand_fwd"] if first else 0.0) + \
                (extra["contract_fwd"] if last else 0.0)
        if kind == "W":
            return subs * extra["w"]
        t = subs * extra["b" if kind == "B" else "bwd"]
        if self.recompute and self.stage_mem[stage].recompute_block:
            t += subs * extra["rc"]
        return t + (extra["expand_bwd"] if first else 0.0) + (extra["contract_bwd"] if last else 0.0)

    def runtime_time(self, a: Action) -> float:
        k = a.kind
        if k in (Kind.F, Kind.I, Kind.W, Kind.B):
            t = self._base_action(f"{k.value}/s{a.stage}", k.value, a.stage) + self._extra_us(a.stage, k.value)
        elif k is Kind.FB:
            key = f"FB/s{a.stage}+s{a.b_stage}"
            if key in self.runtime.action_us:
                base = self.runtime.action_us[key]
            else:  # an F&B pair the baseline never ran: its two halves back to back
                base = self._base_action(f"F/s{a.stage}", "F", a.stage) + \
                    self._base_action(f"B/s{a.b_stage}", "B", a.b_stage)
            t = base + self._extra_us(a.stage, "F") + self._extra_us(a.b_stage, "B")
        else:
            raise ValueError(f"cannot price action kind {k}")
        self.results[(k.value, a.stage) + ((a.b_stage,) if k is Kind.FB else ())] = OverlapResult(t, t, 0.0, 0.0)
        return t

    def compute_time(self, a: Action) -> float:
        k = a.kind
        if self.opt.unit_costs:
            return {Kind.F: 1.0, Kind.I: 1.0, Kind.W: 1.0, Kind.B: 2.0, Kind.FB: 3.0}[k]
        if self.runtime is not None:
            return self.runtime_time(a)
        if k is Kind.F:
            return self._run(("F", a.stage), [self._ops(self.forward_kernels(a.stage), False)], False)
        if k is Kind.I:
            return self._run(("I", a.stage), [self.backward_ops(a.stage, with_w=False)], False)
        if k is Kind.W:
            return self._run(("W", a.stage), [self.backward_ops(a.stage, with_w=True, with_i=False)], False)
        if k is Kind.B:
            return self._run(("B", a.stage), [self.backward_ops(a.stage, with_w=True)], False)
        if k is Kind.FB:
            chains = [self._ops(self.forward_kernels(a.stage), False), self.backward_ops(a.b_stage, with_w=True)]
            return self._run(("FB", a.stage, a.b_stage), chains, True)
        raise ValueError(f"cannot price action kind {k}")

    def fb_forward_share(self, a: Action) -> float:
        """The forward half's share of an F&B pair's work: the runtime runs a pair without communication inside
        its halves as its forward, then its backward, and sends the forward output in between."""
        f, pair = self.compute_time(Action(Kind.F, a.stage, a.mb)), self.compute_time(a)
        return min(1.0, f / pair) if pair > 0 else 0.0

    @property
    def message_bytes(self) -> float:
        return comm.boundary_bytes(self.shape.T, self.width, self.shape.C, self.shape.d)

    def transfer_time(self, a: Action) -> float:
        if self.opt.unit_costs:
            return 0.0
        if self.runtime is not None:  # in-situ latency + bytes over the measured link
            return self.runtime.p2p_latency_us + self.message_bytes / (self.link.bandwidth * self.link.efficiency) * 1e6
        return comm.p2p_us(self.link, self.message_bytes)

    def simulate(self, schedule: Schedule) -> SimResult:
        if self.runtime is not None and not self.opt.unit_costs:
            rt = self.runtime
            return simulate_shared(schedule, self.compute_time, self.transfer_time, rt.cores_by_concurrency,
                                   rt.action_overhead_us, slice_us=rt.time_slice_us,
                                   protect_us=rt.protect_us,
                                   fb_forward_share=self.fb_forward_share if self.cfg.parallel.overlap else None)
        result = simulate(schedule, compute_time=self.compute_time, transfer_time=self.transfer_time)
        cores = self.hw.host_cores
        if cores and schedule.num_ranks > cores:  # CPU ranks sharing cores: stretch by the mean concurrency
            concurrency = sum(result.busy.values()) / result.makespan if result.makespan else 1.0
            self.slowdown = max(1.0, concurrency / cores)
            if self.slowdown > 1.0:
                self.results = {}
                result = simulate(schedule, compute_time=self.compute_time, transfer_time=self.transfer_time)
        return result


def runtime_profile_for(hw: HardwareSpec, cfg: RunConfig):
    """The hardware's runtime profile when it was calibrated for this config's shape (else None: roofline)."""
    prof = hw.runtime
    if prof is None:
        return None
    from costmodel.runtime_profile import runtime_key

    return prof if prof.key == runtime_key(cfg) else None


@dataclass
class Prediction:
    """What `predict` returns: both simulations (with their traces), the ladder, memory and a summary dict."""

    config: RunConfig
    hardware: HardwareSpec
    spec: ResidualSpec
    schedule: Schedule
    baseline: SimResult
    mhc: SimResult
    ladder: dict[str, float]
    pricers: dict[str, Pricer]
    memory: dict[str, list[RankMemory]]
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def traces(self):
        return {"baseline": self.baseline.trace, "mhc": self.mhc.trace}


def _exposed_comm(result: SimResult) -> float:
    """Mean over ranks of comm time not covered by compute."""
    from traces.project import union_length

    per: dict[int, dict[str, list]] = {}
    for s in result.trace.spans:
        per.setdefault(s.rank, {"compute": [], "comm": []})
        per[s.rank]["comm" if s.stream == "comm" else "compute"].append((s.start, s.end))
    vals = [union_length(v["compute"] + v["comm"]) - union_length(v["compute"]) for v in per.values()]
    return sum(vals) / len(vals) if vals else 0.0


def residual_spec_of(cfg: RunConfig, variant: str | None = None, n: int | None = None, k: int | None = None,
                     fused: bool = True) -> ResidualSpec:
    r = cfg.model.residual
    v = variant or r.variant
    n = n if n is not None else (1 if v == "residual" else r.n)
    if n == 1:  # one stream: nothing to mix or select, the plain residual (xHC's k <= N = 1 too)
        v, k = "residual", None
    return ResidualSpec(v, n, k, fused, r.sinkhorn_iters)


def predict(cfg: RunConfig, hardware: str | HardwareSpec, spec: ResidualSpec | None = None,
            options: Options | None = None, *, ladder: bool = True) -> Prediction:
    hw = hardware if isinstance(hardware, HardwareSpec) else get_hardware(hardware)
    options = options or Options()
    spec = spec or residual_spec_of(cfg)
    p = cfg.parallel
    schedule = build(p.schedule, p.ranks, p.microbatches)
    layout = resolve_layout(cfg, schedule, options.allow_uneven)
    base_spec = ResidualSpec.baseline()
    pricers = {"baseline": Pricer(cfg, hw, base_spec, layout, options)}
    pricers["mhc"] = Pricer(cfg, hw, spec, layout, options)
    sims = {name: pr.simulate(schedule) for name, pr in pricers.items()}
    T_base, T_mhc = sims["baseline"].makespan, sims["mhc"].makespan
    steps = {"baseline": T_base}
    if ladder and not spec.is_baseline:
        for name, kw in (("kernels", dict(recompute=False, boundary_width=1)),
                         ("recompute", dict(recompute=True, boundary_width=1))):
            pr = Pricer(cfg, hw, spec, layout, options, **kw)
            pricers[name] = pr
            steps[name] = pr.simulate(schedule).makespan
    else:
        steps["kernels"] = steps["recompute"] = T_mhc
    steps["mhc"] = T_mhc
    memory = {}
    peaks = sims["mhc"].peak_activations
    for name in ("baseline", "mhc"):
        pr = pricers[name]
        memory[name] = [rank_memory(cfg, pr.spec, pr.stage_mem, schedule.stages_of(r), r, peaks[r])
                        for r in range(schedule.num_ranks)]
    norc = {st: stage_memory(cfg, spec, st, *layout[st], recompute=False) for st in layout}
    memory["mhc_no_recompute"] = [rank_memory(cfg, spec, norc, schedule.stages_of(r), r, peaks[r])
                                  for r in range(schedule.num_ranks)]
    pred = Prediction(cfg, hw, spec, schedule, sims["baseline"], sims["mhc"], steps, pricers, memory)
    for name, sim in sims.items():
        sim.trace.meta.update({"source": "predicted", "hardware": hw.name, "residual": pricers[name].spec.label(),
                               "config": cfg.model.name})
    pred.summary = summarize(pred)
    return pred


def _kind_means(sim: SimResult) -> dict[str, float]:
    """Mean simulated duration per compute action kind."""
    out: dict[str, list[float]] = {}
    for s in sim.trace.spans:
        if s.stream == "compute" and s.kind in ("F", "I", "W", "B", "FB"):
            out.setdefault(s.kind, []).append(s.duration)
    return {k: statistics.fmean(v) for k, v in out.items()}


def summarize(pred: Prediction) -> dict[str, Any]:
    base, mhc = pred.baseline, pred.mhc
    Tb, Tm = base.makespan, mhc.makespan
    st = pred.ladder
    pct = lambda x: 100.0 * x / Tb if Tb else 0.0  # noqa: E731
    mean_idle = lambda s: statistics.fmean(s.idle.values())  # noqa: E731
    pb, pm = pred.pricers["baseline"], pred.pricers["mhc"]
    fb_b = [r.makespan for k, r in pb.results.items() if k[0] == "FB"]  # empty with unit costs
    fb_m = [r.makespan for k, r in pm.results.items() if k[0] == "FB"]
    mem = {name: max(r.total_bytes for r in ranks) for name, ranks in pred.memory.items()}
    hw = pred.hardware
    warnings = []
    for name, v in mem.items():
        if v > hw.memory_bytes:
            warnings.append(f"{name}: peak {v / 2**30:.1f} GiB per rank exceeds the {hw.name}'s "
                            f"{hw.memory_bytes / 2**30:.0f} GiB")
    L_r = sorted({m.recompute_block for m in pm.stage_mem.values() if m.recompute_block})
    cfg = pred.config
    if hw.runtime is not None and pb.runtime is None:
        from costmodel.runtime_profile import runtime_key

        have, want = hw.runtime.key, runtime_key(cfg)
        diff = [f"{k} {have.get(k)!r} vs {want[k]!r}" for k in want if have.get(k) != want[k]]
        warnings.append(f"{hw.name}'s runtime profile was calibrated for another shape ({'; '.join(diff)[:200]}): "
                        "priced by the roofline of the host micro-benchmarks, which misses the runtime's per-action "
                        "overheads; calibrate for this config (costmodel.runtime_profile.calibrate_local_for)")
    rc = cfg.recompute
    if rc.mode == "block" and rc.block_size and L_r and max(L_r) < rc.block_size:
        warnings.append(f"recompute.block_size {rc.block_size} exceeds the sub-layers of a stage: blocks of "
                        f"{', '.join(map(str, L_r))} (a whole stage) are used")
    return {
        "config": cfg.model.name, "hardware": hw.name, "residual": pred.spec.label(),
        "schedule": {"kind": pred.schedule.kind, "ranks": pred.schedule.num_ranks,
                     "microbatches": pred.schedule.num_microbatches, "ep": cfg.parallel.expert_parallel,
                     "tokens_per_microbatch": cfg.parallel.tokens_per_microbatch},
        "iteration_us": {"baseline": Tb, "mhc": Tm},
        "overhead_pct": 100.0 * (Tm / Tb - 1.0) if Tb else 0.0,
        "fb_step_overhead_pct": (100.0 * (statistics.median(fb_m) / statistics.median(fb_b) - 1.0)
                                 if fb_b and fb_m else None),
        "breakdown_pp": {"kernel_traffic": pct(st["kernels"] - st["baseline"]),
                         "recompute": pct(st["recompute"] - st["kernels"]),
                         "exposed_comm": pct(st["mhc"] - st["recompute"])},
        "bubble": {"baseline_pct": 100 * base.bubble_fraction, "mhc_pct": 100 * mhc.bubble_fraction,
                   "change_pp": pct(mean_idle(mhc) - mean_idle(base))},
        "exposed_comm_us": {"baseline": _exposed_comm(base), "mhc": _exposed_comm(mhc)},
        "boundary": {"link": pm.link.name, "bytes_baseline": pb.message_bytes, "bytes_mhc": pm.message_bytes,
                     "us_baseline": pb.transfer_time(None), "us_mhc": pm.transfer_time(None)},
        "op_us": {"baseline": _kind_means(base), "mhc": _kind_means(mhc)},
        "memory_gib": {k: v / 2**30 for k, v in mem.items()},
        "recompute_block": L_r,
        "recompute_mode": cfg.recompute.mode,
        "pricing": ("runtime profile (fitted baseline actions + micro-benchmarked residual extra on ranks "
                    "sharing cores(k) = " + ", ".join(f"{c:.2f}" for c in pb.runtime.cores_by_concurrency) +
                    f" in {pb.runtime.time_slice_us / 1e3:.1f} ms slices; P2P latency "
                    f"{pb.runtime.p2p_latency_us:.0f} us)") if pb.runtime is not None else "roofline",
        "warnings": warnings,
    }
