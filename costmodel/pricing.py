"""Per-action pricing for `predict`: the durations of a schedule's F, I, W, B and F&B actions and of its
stage-boundary messages, for one residual variant.

* Layout: every pipeline chain splits the L_b blocks into consecutive stages (configs.stage_blocks); the chain's
  first stage adds the embedding (and the mHC expand), its last the head, loss (and the contract). Uneven
  splits are an error unless allowed.
* An action is priced as a small stream simulation of its kernels (overlap.py): per-op roofline with
  efficiency curves (hardware.py, ops.py), mHC kernels by bytes (mhc_cost.py), all-to-all by alpha-beta
  (comm.py). F, I, W, B and the overlapped F&B step are priced separately, per stage (stages differ at the
  ends). A stage-boundary message costs alpha + T n C d / (bw eta) on the PP link (comm.py).
* A hardware spec that carries a runtime profile for the config (`local` calibrated for this runtime,
  costmodel.runtime_profile) is priced by a ProfilePricing instead, which the caller passes in
  (costmodel.local.host_pricing.HostPricing); this module never imports it.
* `local` without a profile (roofline): compute is stretched by max(1, busy ranks / cores), the mean
  concurrency of a first simulation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from costmodel import comm
from costmodel.hardware import HardwareSpec
from costmodel.memory import StageMemory, stage_memory
from costmodel.mhc_cost import ResidualSpec, recompute_kernel, residual_kernels, stack_ends
from costmodel.ops import Kernel, Shape, block_work, embedding, head
from costmodel.overlap import OverlapResult, TimedOp, overlap
from costmodel.runtime_profile import profile_for
from configs import RunConfig, stage_blocks
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


class ProfilePricing(Protocol):
    """What prices a variant's actions from the hardware's runtime profile instead of the roofline, and simulates
    the schedule with those prices (costmodel.local.host_pricing.HostPricing: ranks sharing the host's cores).
    The Pricer hands itself over: its config, layout, residual spec, recompute flag and stage memory say what
    an action holds; `pricer.runtime` is the profile."""

    def compute_us(self, pricer: "Pricer", action: Action) -> float:
        """Duration of one F, I, W, B or F&B action."""

    def transfer_us(self, pricer: "Pricer") -> float:
        """Duration of one stage-boundary message of the pricer's width."""

    def simulate(self, pricer: "Pricer", schedule: Schedule) -> SimResult:
        """The schedule simulated with the pricer's compute_time and transfer_time."""


class Pricer:
    """Per-action durations for one residual variant: the roofline of the action's kernels, or, for a hardware
    spec that carries a runtime profile for this config, `profile_pricing` (which must then be given)."""

    def __init__(self, cfg: RunConfig, hw: HardwareSpec, spec: ResidualSpec, layout: dict, options: Options,
                 *, recompute: bool = True, boundary_width: int | None = None,
                 profile_pricing: ProfilePricing | None = None):
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
        self.runtime = profile_for(hw, cfg)
        if self.runtime is not None and profile_pricing is None:
            raise ValueError(f"hardware {hw.name!r} carries a runtime profile for this config: price it with "
                             "that profile (predict(..., profile_pricing=costmodel.local.host_pricing.HostPricing()))")
        self.profile_pricing = profile_pricing if self.runtime is not None else None

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

    def compute_time(self, a: Action) -> float:
        k = a.kind
        if self.opt.unit_costs:
            return {Kind.F: 1.0, Kind.I: 1.0, Kind.W: 1.0, Kind.B: 2.0, Kind.FB: 3.0}[k]
        if self.profile_pricing is not None:
            t = self.profile_pricing.compute_us(self, a)
            self.results[(k.value, a.stage) + ((a.b_stage,) if k is Kind.FB else ())] = OverlapResult(t, t, 0.0, 0.0)
            return t
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

    @property
    def message_bytes(self) -> float:
        return comm.boundary_bytes(self.shape.T, self.width, self.shape.C, self.shape.d)

    def transfer_time(self, a: Action) -> float:
        if self.opt.unit_costs:
            return 0.0
        if self.profile_pricing is not None:
            return self.profile_pricing.transfer_us(self)
        return comm.p2p_us(self.link, self.message_bytes)

    def simulate(self, schedule: Schedule) -> SimResult:
        if self.profile_pricing is not None and not self.opt.unit_costs:
            return self.profile_pricing.simulate(self, schedule)
        result = simulate(schedule, compute_time=self.compute_time, transfer_time=self.transfer_time)
        cores = self.hw.host_cores
        if cores and schedule.num_ranks > cores:  # CPU ranks sharing cores: stretch by the mean concurrency
            concurrency = sum(result.busy.values()) / result.makespan if result.makespan else 1.0
            self.slowdown = max(1.0, concurrency / cores)
            if self.slowdown > 1.0:
                self.results = {}
                result = simulate(schedule, compute_time=self.compute_time, transfer_time=self.transfer_time)
        return result
