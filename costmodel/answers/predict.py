"""`predict(run_config, hardware)`: price every schedule action for the baseline (n = 1) and for mHC, simulate
both, and explain the difference.

Steps:
1. Build the schedule (schedules.build) and map stages to blocks (pricing.resolve_layout).
2. Price each action and each stage-boundary message per residual variant (pricing.Pricer: the roofline of
   the action's kernels, or a runtime profile's prices through the ProfilePricing the caller passes).
3. Simulate (schedules.simulate, or the ProfilePricing's simulation): compute spans per rank, transfers on
   their own channel; exposed communication and bubbles come out of the simulation.
4. When asked (`ladder=True`, `mhcpipe predict --breakdown`): attribute the overhead by a ladder of
   counterfactual simulations that adds one mechanism at a time: baseline -> + mHC kernels (no recompute, boundary
   at baseline width) -> + recompute -> + n-fold boundary traffic (the full mHC run). The steps sum exactly to the
   overhead. The change of the mean idle time per rank (bubble) is reported alongside; it is part of those steps,
   not an extra term. Two more simulations, a quarter of DeepSeek-V3's predict: not by default.
5. Memory per rank (memory.py) and a summary dict (what `mhcpipe predict` prints and writes as JSON).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from costmodel.simulation.fb_stage import fb_stage_us, overhead_pct, pair_table
from costmodel.physics.hardware import HardwareSpec, curve_warnings, get_hardware
from costmodel.pricing.data_parallel import GradSync, grad_sync
from costmodel.physics.memory import RankMemory, rank_memory, stage_memory
from costmodel.physics.mhc_cost import ResidualSpec
from costmodel.physics.ops import forward_flops_per_token
from costmodel.pricing.pricer import Pricer, ProfilePricing
from costmodel.pricing.stage_split import resolve_layout
from costmodel.pricing.options import Options
from costmodel.physics.runtime_profile import runtime_key
from configs import RunConfig
from schedules.build import build
from schedules.ir import Schedule
from schedules.simulate import SimResult
from traces.analysis.sim_path import simulated_path
from traces.trace import collector_paused, union_length


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
    # the data-parallel gradient all-reduces of each run (data_parallel.grad_sync); None with one replica
    syncs: dict[str, GradSync] | None = None

    @property
    def traces(self):
        return {"baseline": self.baseline.trace, "mhc": self.mhc.trace}


def _comm_outside_compute(result: SimResult) -> float:
    """Mean over ranks of comm time not covered by compute on that rank (it includes transfers during a rank's
    idle time, which need not delay the step: the critical path says which do)."""
    per: dict[int, tuple[list, list]] = {}  # rank -> (compute intervals, comm intervals)
    for s in result.trace.spans:
        lists = per.get(s.rank)
        if lists is None:
            lists = per[s.rank] = ([], [])
        lists[s.stream == "comm"].append((s.start, s.start + s.duration))
    vals = [union_length(compute + comm) - union_length(compute) for compute, comm in per.values()]
    return sum(vals) / len(vals) if vals else 0.0


def residual_spec_of(cfg: RunConfig, variant: str | None = None, n: int | None = None, k: int | None = None,
                     fused: bool = True) -> ResidualSpec:
    r = cfg.model.residual
    v = variant or r.variant
    n = n if n is not None else (1 if v == "residual" else r.n)
    if v == "xhc" and r.variant == "xhc":  # the config's own xHC: its k, and Flash (xHC's fused form) as it says
        k = r.k if k is None else k
        fused = fused and r.flash
    if n == 1:  # one stream: nothing to mix or select, the plain residual (xHC's k <= N = 1 too)
        v, k = "residual", None
    return ResidualSpec(v, n, k, fused, r.sinkhorn_iters)


def predict(cfg: RunConfig, hardware: str | HardwareSpec, spec: ResidualSpec | None = None,
            options: Options | None = None, *, ladder: bool = False,
            profile_pricing: ProfilePricing | None = None) -> Prediction:
    """Baseline and mHC (`spec`, default the config's residual) on `hardware` (see the module docstring).
    `ladder`: also split the overhead (summary["breakdown_pp"]; None without it). `profile_pricing` prices a
    hardware spec that carries a runtime profile for this config (required then; costmodel.local.host_pricing.
    HostPricing for `local`)."""
    # ~10^5 short-lived objects (spans, kernel chains, records), no cycles a collection would free: without the
    # collector's passes over them (and over everything imported) DeepSeek-V3's predict takes 0.21 instead of 0.24 s
    # in-process (bench/results/costmodel_speed_collector.json; the CLI raises its threshold for the same reason)
    with collector_paused():
        return _predict(cfg, hardware, spec, options, ladder, profile_pricing)


def _predict(cfg: RunConfig, hardware: str | HardwareSpec, spec: ResidualSpec | None, options: Options | None,
             ladder: bool, profile_pricing: ProfilePricing | None) -> Prediction:
    hw = hardware if isinstance(hardware, HardwareSpec) else get_hardware(hardware)
    options = options or Options()
    spec = spec or residual_spec_of(cfg)
    p = cfg.parallel
    schedule = build(p.schedule, p.ranks, p.microbatches_per_replica)  # one data-parallel replica's pipeline
    layout = resolve_layout(cfg, schedule, options.allow_uneven, split=options.split, hw=hw)
    base_spec = ResidualSpec.baseline()
    pricers = {"baseline": Pricer(cfg, hw, base_spec, layout, options, profile_pricing=profile_pricing)}
    pricers["mhc"] = Pricer(cfg, hw, spec, layout, options, profile_pricing=profile_pricing)
    sims = {name: pr.simulate(schedule) for name, pr in pricers.items()}
    T_base, T_mhc = sims["baseline"].makespan, sims["mhc"].makespan
    steps = {"baseline": T_base}
    if ladder and not spec.is_baseline:
        for name, kw in (("kernels", dict(recompute=False, boundary_width=1)),
                         ("recompute", dict(recompute=True, boundary_width=1))):
            pr = Pricer(cfg, hw, spec, layout, options, profile_pricing=profile_pricing, **kw)
            pricers[name] = pr
            steps[name] = pr.simulate(schedule, record=False).makespan  # a rung is its step time: no spans
    elif ladder:  # mHC is the baseline here: nothing to split
        steps["kernels"] = steps["recompute"] = T_mhc
    steps["mhc"] = T_mhc
    memory = {}
    for name in ("baseline", "mhc"):
        pr = pricers[name]
        memory[name] = [rank_memory(cfg, pr.spec, pr.stage_mem, schedule.stages_of(r), r, schedule.actions[r], hw=hw,
                                    ep_per_node=options.ep_per_node) for r in range(schedule.num_ranks)]
    norc = {st: stage_memory(cfg, spec, st, *layout[st], recompute=False) for st in layout}
    memory["mhc_no_recompute"] = [rank_memory(cfg, spec, norc, schedule.stages_of(r), r, schedule.actions[r], hw=hw,
                                              ep_per_node=options.ep_per_node) for r in range(schedule.num_ranks)]
    syncs = None
    if p.data_parallel > 1:  # a step ends when its last gradient all-reduce does (tune's step, the same function)
        syncs = {name: grad_sync(cfg, hw, schedule, sims[name], layout,
                                 {s: m.params for s, m in pricers[name].stage_mem.items()}) for name in sims}
    pred = Prediction(cfg, hw, spec, schedule, sims["baseline"], sims["mhc"], steps, pricers, memory, syncs=syncs)
    for name, sim in sims.items():
        sim.trace.meta.update({"source": "predicted", "hardware": hw.name, "residual": pricers[name].spec.label(),
                               "config": cfg.model.name})
    pred.summary = summarize(pred)
    return pred


def fb_pair_bounds(pricer: Pricer) -> dict[str, float] | None:
    """The overlapped F&B pairs as priced (their kernels in the option's issue order, Options.fb_order, on the
    compute, hp and comm streams), means over the pairs: the pair's time, its all-to-all with no compute under it,
    and the bound of a pair whose communication is fully hidden, max(compute, communication): what any issue order
    approaches at best. None without F&B pairs."""
    pairs = [r for k, r in pricer.results.items() if k[0] == "FB"]
    if not pairs:
        return None
    return {"priced": statistics.fmean(r.makespan for r in pairs),
            "exposed_comm": statistics.fmean(r.exposed_comm for r in pairs),
            "hidden_bound": statistics.fmean(max(r.compute_busy, r.comm_busy) for r in pairs)}


def _kind_means(sim: SimResult) -> dict[str, float]:
    """Mean simulated duration per compute action kind."""
    out: dict[str, list[float]] = {}
    for s in sim.trace.spans:
        if s.stream == "compute" and s.kind in ("F", "I", "W", "B", "FB"):
            out.setdefault(s.kind, []).append(s.duration)
    return {k: statistics.fmean(v) for k, v in out.items()}


def _memory_terms(ranks: list[RankMemory]) -> dict[str, float]:
    r = max(ranks, key=lambda r: r.total_bytes)
    return {"rank": r.rank, "model_states": r.model_state_bytes / 2**30, "activations": r.activation_bytes / 2**30,
            "transient_and_buffers": (r.transient_bytes + r.buffer_bytes) / 2**30, "reserve": r.reserve_bytes / 2**30}


def _general_path(trace):
    """The critical path of a trace that is not a plain simulated step (a runtime profile's): the general span
    graph, imported here because predict's own steps never need it (it brings numpy and the trace analyses into
    every `mhcpipe predict`'s start-up, ~0.1 s)."""
    from traces.analysis.critical_path import critical_path

    return critical_path(trace)


def summarize(pred: Prediction) -> dict[str, Any]:
    base, mhc = pred.baseline, pred.mhc
    # exposed communication = transfer time on the step's critical path (across ranks), not transfer time
    # outside a rank's compute, which counts transfers that run while the rank would idle anyway
    # (sim_path walks a simulated step's path alone, ~10x faster, the same numbers; any other trace, such as a
    # runtime profile's simulation, goes through the general graph)
    paths = {name: simulated_path(s.trace) or _general_path(s.trace) for name, s in (("baseline", base), ("mhc", mhc))}
    Pb, Pm = base.makespan, mhc.makespan  # one replica's pipeline
    sync = pred.syncs or {}
    exposed = {name: (sync[name].exposed_us if name in sync else 0.0) for name in ("baseline", "mhc")}
    Tb, Tm = Pb + exposed["baseline"], Pm + exposed["mhc"]  # the step: the pipeline, then what the sync adds
    st = pred.ladder
    def pct(x: float) -> float:
        return 100.0 * x / Tb if Tb else 0.0

    def mean_idle(s) -> float:
        return statistics.fmean(s.idle.values())

    pb, pm = pred.pricers["baseline"], pred.pricers["mhc"]
    fb_us = {"baseline": fb_stage_us(base), "mhc": fb_stage_us(mhc)}
    alone = {name: {(k[1], k[2]): r.makespan * pr.slowdown for k, r in pr.results.items() if k[0] == "FB"}
             for name, pr in (("baseline", pb), ("mhc", pm))}
    pairs = pair_table({"baseline": base, "mhc": mhc}, alone)
    mem = {name: max(r.total_bytes for r in ranks) for name, ranks in pred.memory.items()}
    hw = pred.hardware
    cfg = pred.config
    par = cfg.parallel
    tokens = par.microbatches * par.tokens_per_microbatch  # the global batch of one step
    gpus = par.world_size
    # MFU: 3 x the model's forward matmul FLOPs per token (MTP included) per second, over the GPUs' dense bf16
    # peak, whatever precision the GEMMs run in; in two conventions: causal attention counted as computed (half
    # the score matrix), and PaLM's (App. B: the full score matrix), which is what most papers report
    flops_token = 3 * forward_flops_per_token(cfg)
    flops_token_palm = 3 * forward_flops_per_token(cfg, causal=False)
    throughput = {name: tokens / (T * 1e-6) / gpus if T else 0.0 for name, T in (("baseline", Tb), ("mhc", Tm))}
    warnings = []
    for name, v in mem.items():
        if v > hw.memory_bytes:
            warnings.append(f"{name}: peak {v / 2**30:.1f} GiB per rank exceeds the {hw.name}'s "
                            f"{hw.memory_bytes / 2**30:.0f} GiB")
    L_r = sorted({m.recompute_block for m in pm.stage_mem.values() if m.recompute_block})
    if hw.runtime is not None and pb.runtime is None:
        have, want = hw.runtime.key, runtime_key(cfg)
        diff = [f"{k} {have.get(k)!r} vs {want[k]!r}" for k in want if have.get(k) != want[k]]
        warnings.append(f"{hw.name}'s runtime profile was calibrated for another shape ({'; '.join(diff)[:200]}): "
                        "priced by the roofline of the host micro-benchmarks, which misses the runtime's per-action "
                        "overheads; calibrate for this config (costmodel.local.calibration.calibrate_local_for)")
    rc = cfg.recompute
    if rc.mode == "block" and rc.block_size and L_r and max(L_r) < rc.block_size:
        warnings.append(f"recompute.block_size {rc.block_size} exceeds the sub-layers of a stage: blocks of "
                        f"{', '.join(map(str, L_r))} (a whole stage) are used")
    # efficiency curves extrapolated flat: one line per curve over all pricers (hardware.CurveLookups)
    warnings += curve_warnings(pr.curve_lookups for pr in pred.pricers.values())
    return {
        "config": cfg.model.name, "hardware": hw.name, "residual": pred.spec.label(),
        "schedule": {"kind": pred.schedule.kind, "ranks": pred.schedule.num_ranks,
                     "microbatches": pred.schedule.num_microbatches, "ep": cfg.parallel.expert_parallel,
                     "tokens_per_microbatch": cfg.parallel.tokens_per_microbatch},
        # a training step: one replica's pipeline plus the exposed part of the gradient all-reduce (D > 1)
        "iteration_us": {"baseline": Tb, "mhc": Tm},
        # the busiest rank's compute over the mean rank's (stage imbalance: what a balanced split removes)
        "rank_busy_max_over_mean": {name: max(sim.busy.values()) / statistics.fmean(sim.busy.values())
                                    for name, sim in (("baseline", base), ("mhc", mhc))},
        "stage_blocks": [len(pb.layout[st][0]) for st in pred.schedule.pipelines[0]],
        # how the blocks were cut: balanced (by cost), the config's parallel.stage_split, or even
        "split": (pb.opt.split if pb.opt.split == "balanced" else
                  "config" if cfg.parallel.stage_split is not None else "even"),
        "pipeline_us": {"baseline": Pb, "mhc": Pm},
        "grad_sync_us": {name: ({"exposed": sync[name].exposed_us, "busiest_rank": sync[name].busiest_us}
                                if name in sync else None) for name in ("baseline", "mhc")},
        "data_parallel": cfg.parallel.data_parallel,
        "gpus": gpus,
        "tokens_per_step": tokens,
        "tokens_per_s_per_gpu": throughput,
        "mfu_pct": {name: 100 * v * flops_token / hw.peak("bf16") for name, v in throughput.items()},
        "mfu_palm_pct": {name: 100 * v * flops_token_palm / hw.peak("bf16") for name, v in throughput.items()},
        "model_tflop_per_token": flops_token / 1e12,
        "model_tflop_per_token_palm": flops_token_palm / 1e12,
        # the paper's measure: the overlapped F&B stage as the step runs it (fb_stage.py); the step's beside it
        "fb_stage_overhead_pct": overhead_pct(fb_us["mhc"], fb_us["baseline"]),
        "step_overhead_pct": 100.0 * (Tm / Tb - 1.0) if Tb else 0.0,
        "fb_stage_us": fb_us,
        "fb_pair_us": {name: fb_pair_bounds(pr) for name, pr in (("baseline", pb), ("mhc", pm))},
        "fb_order": pb.opt.fb_order,
        "fb_pairs": [row.to_json() for row in pairs],
        # the ladder's split of the overhead (predict(ladder=True), --breakdown); None when it was not simulated
        "breakdown_pp": {"kernel_traffic": pct(st["kernels"] - st["baseline"]),
                         "recompute": pct(st["recompute"] - st["kernels"]),
                         "exposed_comm": pct(st["mhc"] - st["recompute"]),
                         "gradient_sync": pct(exposed["mhc"] - exposed["baseline"])} if "kernels" in st else None,
        "bubble": {"baseline_pct": 100 * base.bubble_fraction, "mhc_pct": 100 * mhc.bubble_fraction,
                   "change_pp": pct(mean_idle(mhc) - mean_idle(base))},
        "exposed_comm_us": {"baseline": paths["baseline"].exposed_comm_us, "mhc": paths["mhc"].exposed_comm_us},
        "comm_outside_compute_us": {"baseline": _comm_outside_compute(base), "mhc": _comm_outside_compute(mhc)},
        "critical_path_us": {name: {k: v for k, v in sorted(cp.by_kind.items())} for name, cp in paths.items()},
        "boundary": {"link": pm.link.name, "bytes_baseline": pb.message_bytes, "bytes_mhc": pm.message_bytes,
                     "us_baseline": pb.transfer_time(None), "us_mhc": pm.transfer_time(None)},
        "op_us": {"baseline": _kind_means(base), "mhc": _kind_means(mhc)},
        "memory_gib": {k: v / 2**30 for k, v in mem.items()},
        # the mHC run's peak rank by term (memory.RankMemory; reserve = CUDA context, NCCL, DeepEP, fragmentation)
        "memory_terms_gib": _memory_terms(pred.memory["mhc"]),
        "recompute_block": L_r,
        "recompute_mode": cfg.recompute.mode,
        "pricing": ("runtime profile (fitted baseline actions + micro-benchmarked residual extra on ranks "
                    "sharing cores(k) = " + ", ".join(f"{c:.2f}" for c in pb.runtime.cores_by_concurrency) +
                    f" in {pb.runtime.time_slice_us / 1e3:.1f} ms slices; P2P latency "
                    f"{pb.runtime.p2p_latency_us:.0f} us)") if pb.runtime is not None else "roofline",
        "warnings": warnings,
    }
