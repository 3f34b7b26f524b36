"""Per-action pricing for `predict`: the durations of a schedule's F, I, W, B and F&B actions and of its
stage-boundary messages, for one residual variant.

* Layout (stage_split.resolve_layout): every pipeline chain splits the L_b blocks into consecutive stages; the chain's
  first stage adds the embedding (and the mHC expand), its last the head, loss (and the contract). Uneven
  splits are an error unless allowed.
* An action is priced as a small stream simulation of its kernels (overlap.py): per-op roofline with
  efficiency curves (hardware.py, ops.py), mHC kernels by bytes (mhc_cost.py), all-to-all by alpha-beta
  (comm.py). F, I, W, B and the overlapped F&B step are priced separately, per stage (stages differ at the
  ends). A stage-boundary message costs alpha + T n C d / (bw eta) on the PP link (comm.py).
* A hardware spec that carries a runtime profile for the config (`local` calibrated for this runtime,
  costmodel.physics.runtime_profile) is priced by a ProfilePricing instead, which the caller passes in
  (costmodel.local.host_pricing.HostPricing); this module never imports it.
* `local` without a profile (roofline): compute is stretched by max(1, busy ranks / cores), the mean
  concurrency of a first simulation.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Protocol

from costmodel.physics import comm_cost as comm
from costmodel.physics.hardware import CurveLookups, HardwareSpec
from costmodel.physics.memory import StageMemory, stage_memory
from costmodel.physics.mhc_cost import ResidualSpec, recompute_kernels, residual_kernels, stack_ends, stage_entry
from costmodel.physics.ops import Kernel, Shape, block_work, embedding, head, mtp_prelude
from costmodel.pricing.fb_overlap import Chain, OverlapResult, TimedOp, floor, overlap
from costmodel.pricing.options import Options
from costmodel.physics.runtime_profile import profile_for
from configs import RunConfig
from schedules.ir import Action, Kind, Schedule
from schedules.simulate import SimResult, simulate


MHC_GROUPS = ("mhc", "recompute")  # kernels priced at the hardware's mhc_memory_eff when it has one


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
        self.shape = replace(Shape.of(cfg), attn_bwd=hw.attention_bwd_factor)
        self.recompute = recompute and options.recompute
        self.width = spec.width if boundary_width is None else boundary_width
        self.sigma = hw.interference if options.sigma is None else options.sigma
        dp = cfg.parallel.data_parallel if options.data_parallel is None else options.data_parallel
        link = comm.pp_link(hw, cfg.parallel.ranks, dp, cfg.parallel.expert_parallel, options.ep_per_node)
        pp_on_network = link is hw.inter
        if options.pp_bandwidth is not None:
            link = link.with_bandwidth(options.pp_bandwidth)
        self.link = link
        if cfg.train.fp8 and "fp8" not in hw.peak_flops:
            raise ValueError(f"train.fp8: the {hw.name} has no FP8 tensor-core rate (peak_flops has "
                             f"{', '.join(hw.peak_flops)}); drop train.fp8 or choose hardware with one "
                             "(h800, h100, h200, b200)")
        self.slowdown = 1.0
        self.results: dict[tuple, OverlapResult] = {}  # per (kind, stage[, backward stage]), inputs on time
        self._lagged: dict[tuple, OverlapResult] = {}  # F&B pairs whose halves' inputs arrived late
        self._chain_cache: dict[tuple, list[TimedOp]] = {}  # (kind, stage key) -> its chain
        comm_sms = hw.comm_sms if options.comm_sms is None else options.comm_sms
        if not 0 <= comm_sms < hw.sms:
            raise ValueError(f"comm_sms {comm_sms}: the SMs the all-to-all occupies must be >= 0 and fewer than the "
                             f"{hw.name}'s {hw.sms} SMs")
        self.comm_share = comm_sms / hw.sms
        self.stage_mem: dict[int, StageMemory] = {
            st: self._stage_memory(st, blocks, first, last) for st, (blocks, first, last) in layout.items()}
        self.runtime = profile_for(hw, cfg)
        if self.runtime is not None and profile_pricing is None:
            raise ValueError(f"hardware {hw.name!r} carries a runtime profile for this config: price it with "
                             "that profile (predict(..., profile_pricing=costmodel.local.host_pricing.HostPricing()))")
        self.profile_pricing = profile_pricing if self.runtime is not None else None
        self.curve_lookups = CurveLookups(hw)  # efficiency lookups outside a curve's points (summary warnings)
        moe, ep = cfg.model.moe, cfg.parallel.expert_parallel
        self.routing = (None if moe is None or options.dispatcher == "alltoall"
                        else (moe.num_experts, moe.top_k, moe.max_nodes_per_token))
        # one NIC for P2P and all-to-all (comm.py): an action's P2P bytes spread over its all-to-alls, 2 per MoE
        # block (dispatch, combine), the mean MoE blocks of a stage
        self.nic_bytes = 0.0
        moe_blocks = 0 if moe is None else cfg.model.num_blocks - moe.first_dense_blocks
        if pp_on_network and moe_blocks and ep > comm.ep_ranks_per_node(hw, ep, options.ep_per_node):
            chains = sum(1 for _, first, _ in layout.values() if first)
            self.nic_bytes = self.message_bytes / (2 * moe_blocks * chains / len(layout))
        # what an action's kernels depend on besides the shape: which of the stage's blocks are dense, first or last
        # of its pipeline, L_r (ops.block_work reads the block index only to tell dense from MoE). Stages with one
        # key share their chains and stream simulations: a 16-stage pipeline prices 3 kinds of stage, not 16.
        fd = 0 if cfg.model.moe is None else cfg.model.moe.first_dense_blocks
        self.stage_key = {st: (tuple(b < fd for b in blocks), first, last, self.stage_mem[st].recompute_block)
                          for st, (blocks, first, last) in layout.items()}
        # per chain kind, the stage key it depends on: the forward and the weight gradients never recompute
        # (backward_ops adds recompute kernels to the I chain only), so stages and layouts that differ in L_r alone
        # share their F and W chains and prices
        no_lr = {st: k[:3] for st, k in self.stage_key.items()}
        self.chain_key = {Kind.F: no_lr, Kind.W: no_lr, Kind.I: self.stage_key, Kind.B: self.stage_key}
        self._blocks: dict[bool, list[tuple]] = {}  # dense? -> _block
        self._timed: dict[tuple[Kernel, bool], TimedOp] = {}  # (kernel, backward) -> its timed op
        self._runs: dict[tuple, OverlapResult] = {}  # per shape key (_shape_key): the action's stream simulation

    def _stage_memory(self, stage: int, blocks: range, first: bool, last: bool) -> StageMemory:
        return stage_memory(self.cfg, self.spec, stage, blocks, first, last, self.recompute)

    # ---- kernels -> timed ops ---------------------------------------------------------------------------
    def kernel_us(self, k: Kernel, backward: bool) -> float:
        hw = self.hw
        self.curve_lookups.add(k.name, k.cls, k.flops, k.nbytes)
        launch = (hw.backward_launch_us if backward else hw.launch_us) * k.launches
        if k.cls == "a2a":
            return comm.all_to_all_us(hw, self.shape.ep, k.nbytes, self.opt.ep_per_node, self.routing,
                                      self.nic_bytes)
        mhc = self._on_mhc_curve(k)
        if k.cls == "matrix":  # an FP8 GEMM's quantisation pass runs before it (ops.linear)
            quant = hw.memory_us(k.quant_bytes) + launch if k.quant_bytes else 0.0
            return hw.matmul_us(k.flops, k.nbytes, k.dtype, mhc, k.op) + launch + quant
        if k.cls == "vector":
            return hw.vector_us(k.flops, k.nbytes, mhc) + launch
        if k.cls == "memory":
            return hw.memory_us(k.nbytes, mhc) + launch
        return launch

    def demand(self, k: Kernel, duration: float) -> tuple[float, float]:
        """(share of the SMs, share of the peak HBM bandwidth) the kernel occupies at full rate over its
        `duration` (overlap.py's fluid model): its compute time fills the SMs; its memory time needs
        `bandwidth_sm_share` of them and draws bytes / peak bandwidth; the launch gap uses neither."""
        hw = self.hw
        if k.cls in ("a2a", "sync") or duration <= 0:
            return 0.0, 0.0
        t_mem = hw.memory_us(k.nbytes, self._on_mhc_curve(k))
        t_cmp = 0.0
        if k.flops > 0 and k.cls == "matrix":
            t_cmp = hw.matmul_compute_us(k.flops, k.dtype, k.op)
        elif k.flops > 0 and k.cls == "vector":
            t_cmp = k.flops / (hw.vector_flops * hw.vector_eff(k.flops / 1e9)) * 1e6
        sm = min(1.0, max(t_cmp, hw.bandwidth_sm_share * t_mem) / duration)
        hbm = min(1.0, k.nbytes / hw.hbm_bandwidth * 1e6 / duration)
        return sm, hbm

    def _on_mhc_curve(self, k: Kernel) -> bool:
        """mHC's own kernels (and their recompute) run at the spec's mhc_memory_eff; the plain residual's add and
        norm rebuild are ordinary elementwise kernels."""
        return k.group in MHC_GROUPS and not self.spec.is_baseline

    def _ops(self, kernels: list[Kernel], backward: bool) -> list[TimedOp]:
        out = []
        for k in kernels:
            op = self._timed.get((k, backward))
            if op is None:  # every block of a stage (and every stage) repeats the same kernels: time each once
                t = self.kernel_us(k, backward)
                sm, hbm = self.demand(k, t)
                op = self._timed[(k, backward)] = TimedOp(k.name, k.group, k.stream, t, k.deps, k.preemptible, sm, hbm)
            out.append(op)
        return out

    def _sublayers(self, stage: int):
        for dense in self.stage_key[stage][0]:
            yield from self._block(dense)

    def _block(self, dense: bool) -> list[tuple]:
        """(work, residual kernels before, after, backward) of a block's two sub-layers: block_work reads the block
        index only to tell dense from MoE, so one of each kind serves every block."""
        subs = self._blocks.get(dense)
        if subs is None:
            s, spec, hp = self.shape, self.spec, self.opt.hp_stream
            subs = self._blocks[dense] = [
                (work, *residual_kernels(spec, s.T, s.C, s.d, work.kind != "attn", hp))
                for work in block_work(s, 0 if dense else self.cfg.model.num_blocks)]
        return subs

    def forward_kernels(self, stage: int) -> list[Kernel]:
        return [k for seg in self._forward_segments(stage) for k in seg]

    def _forward_segments(self, stage: int) -> list[list[Kernel]]:
        """The forward's kernels cut at block boundaries (the embedding and the head are segments of their own)."""
        blocks, first, last = self.layout[stage]
        s = self.shape
        expand, contract = stack_ends(self.spec, s.T, s.C, s.d)
        segs: list[list[Kernel]] = []
        if first:
            segs.append(embedding(s).F + expand)
        subs = list(self._sublayers(stage))
        entry = stage_entry(self.spec, s.T, s.C, s.d)[0]  # mhc-sp: mix the received state for the first sub-layer
        for j in range(0, len(subs), 2):
            seg: list[Kernel] = [] if j else list(entry)
            for work, before, after, _ in subs[j:j + 2]:
                seg += before + work.F + after
            segs.append(seg)
        if last:
            segs.append(contract + head(s).F)
            for _ in range(s.mtp):  # each MTP module: its entry, one MoE block in the residual, the shared head
                segs.append(mtp_prelude(s).F + expand)
                segs.append([k for work, before, after, _ in self._block(False) for k in before + work.F + after])
                segs.append(contract + head(s).F)
        return segs

    def forward_ops(self, stage: int) -> list[TimedOp]:
        """The forward chain: a switch point after every segment, the output at its last kernel."""
        ops: list[TimedOp] = []
        for seg in self._forward_segments(stage):
            timed = self._ops(seg, backward=False)
            if timed:
                timed[-1] = timed[-1].with_(switch=True)
            ops += timed
        if ops:
            ops[-1] = ops[-1].with_(output=True)
        return ops

    def backward_ops(self, stage: int, with_w: bool, with_i: bool = True) -> list[TimedOp]:
        """The I chain (with_w=False), the W chain (with_i=False) or the full backward B (both). W kernels are
        `deferrable` (an F&B pair runs them in gaps), a switch point follows every block, and the input
        gradient (the output sent upstream) is ready at the last I kernel."""
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
                timed = [o.with_(deps=(anchor - len(ops) - j,) if anchor >= 0 else (), deferrable=True)
                         for j, o in enumerate(timed)]
            elif timed:  # an I kernel waits for the previous I kernel, not for W kernels queued in between
                o = timed[0]
                assert o.deps == (-1,), f"{o.name}: a chain's first kernel depends on the previous one"
                timed[0] = o.with_(deps=(last_i[-1] - len(ops),) if last_i else ())
                last_i.append(len(ops) + len(timed) - 1)
            ops.extend(timed)

        def switch() -> None:
            if ops:
                ops[-1] = ops[-1].with_(switch=True)

        def sublayer(sub: tuple) -> None:
            """One sub-layer's backward: its residual kernels around the sub-layer's I (the post/res backward
            first, mHC), then its W anchored on the first I kernel."""
            work, _, after, bwd = sub
            start = len(ops)
            if with_i:
                split = 0 if spec.is_baseline else len(after)
                add(bwd[:split] + work.I + bwd[split:])
            if with_w:
                add(work.W, start if with_i else -1)

        if last:
            h = head(s)
            for _ in range(s.mtp):  # MTP first: its gradient joins the main head's at the last block's output
                start = len(ops)
                if with_i:
                    add(h.I + contract)
                if with_w:
                    add(h.W, start if with_i else -1)
                for sub in reversed(self._block(False)):
                    sublayer(sub)
                switch()
                pre, start = mtp_prelude(s), len(ops)
                if with_i:
                    add(expand + pre.I)
                if with_w:
                    add(pre.W, start if with_i else -1)
                switch()
            if with_i:
                add(h.I + [kk.scaled(1.0) for kk in contract])
            if with_w:
                add(h.W, len(ops) - len(h.I) - len(contract) if with_i else -1)
            switch()
        for idx in range(len(subs) - 1, -1, -1):
            if with_i and L_r and (idx == L - 1 or (idx + 1) % L_r == 0):
                rcs = recompute_kernels(spec, s.T, s.C, s.d, idx - (idx // L_r) * L_r + 1)
                if rcs:  # entering a recompute block from its end: rebuild its mHC intermediates and F's norms
                    add(rcs)
            sublayer(subs[idx])
            if idx % 2 == 0:
                switch()
        if with_i and stage_entry(spec, s.T, s.C, s.d)[1]:
            add(stage_entry(spec, s.T, s.C, s.d)[1])
        if first:
            e = embedding(s)
            if with_i:
                add(expand)
            if with_w:
                add(e.W, len(ops) - 1 if with_i and ops else -1)
        if with_i and last_i:
            ops[last_i[-1]] = ops[last_i[-1]].with_(output=True)
        return ops

    # ---- schedule callbacks -----------------------------------------------------------------------------
    def _run(self, chains: list[list[TimedOp]], fb: bool, lags: tuple[float, float] | None = None) -> OverlapResult:
        mode = self.opt.fb_mode if fb else self.opt.single_action_mode
        deepseek = self.opt.fb_order == "deepseek"
        return overlap(chains, mode, self.sigma, self.opt.hp_stream, corun=self.opt.corun,
                       comm_share=self.comm_share, lags=lags, wfill="program" if deepseek else "end",
                       b_first=deepseek)

    def _chains(self, a: Action) -> list[list[TimedOp]]:
        """The action's kernel chains: an F&B pair's are its forward's F chain and its backward's B chain."""
        k = a.kind
        if k is Kind.FB:
            return [self._chain(Kind.F, a.stage), self._chain(Kind.B, a.b_stage)]
        if k not in (Kind.F, Kind.I, Kind.W, Kind.B):
            raise ValueError(f"cannot price action kind {k}")
        return [self._chain(k, a.stage)]

    def _chain(self, kind: Kind, stage: int) -> list[TimedOp]:
        """One chain, built once per kind and stage key (the pricing reads chains, never changes them)."""
        key = (kind.value, self.chain_key[kind][stage])
        chain = self._chain_cache.get(key)
        if chain is None:
            chain = self._chain_cache[key] = Chain(self._build_chain(kind, stage))
        return chain

    def _build_chain(self, kind: Kind, stage: int) -> list[TimedOp]:
        if kind is Kind.F:
            return self.forward_ops(stage)
        if kind is Kind.I:
            return self.backward_ops(stage, with_w=False)
        if kind is Kind.W:
            return self.backward_ops(stage, with_w=True, with_i=False)
        return self.backward_ops(stage, with_w=True)

    @staticmethod
    def _key(a: Action) -> tuple:
        return (a.kind.value, a.stage) + ((a.b_stage,) if a.kind is Kind.FB else ())

    def _shape_key(self, a: Action) -> tuple:
        """What the action's price depends on: its kind and its stage's (and backward stage's) key."""
        k = a.kind
        if k is Kind.FB:
            return (k.value, self.chain_key[Kind.F][a.stage], self.stage_key[a.b_stage])
        return (k.value, self.chain_key.get(k, self.stage_key)[a.stage])  # other kinds: _chains says why not

    def compute_time(self, a: Action) -> float:
        k = a.kind
        if self.opt.unit_costs:
            return {Kind.F: 1.0, Kind.I: 1.0, Kind.W: 1.0, Kind.B: 2.0, Kind.FB: 3.0}[k]
        if self.profile_pricing is not None:
            t = self.profile_pricing.compute_us(self, a)
            self.results[self._key(a)] = OverlapResult(t, t, 0.0, 0.0, release=(t, t))
            return t
        skey = self._shape_key(a)
        res = self._runs.get(skey)
        if res is None:
            res = self._runs[skey] = self._run(self._chains(a), k is Kind.FB)
        self.results[self._key(a)] = res
        return res.makespan * self.slowdown

    def floor_time(self, a: Action) -> float:
        """A lower bound on compute_time(a) without its stream simulation (fb_overlap.floor); compute_time itself
        where the price is not a stream run (unit costs, a runtime profile)."""
        if self.opt.unit_costs or self.profile_pricing is not None:
            return self.compute_time(a)
        mode = self.opt.fb_mode if a.kind is Kind.FB else self.opt.single_action_mode
        return floor(self._chains(a), mode, self.opt.hp_stream) * self.slowdown

    def fb_timing(self, a: Action, lag_f: float, lag_b: float) -> tuple[float, float, float]:
        """An F&B pair started while its halves' inputs arrive `lag_f` / `lag_b` later: (duration, when the
        forward's output is ready, when the input gradient is ready), all from the pair's start."""
        key = self._key(a)
        if self.opt.unit_costs or self.profile_pricing is not None:  # one span: both inputs first, outputs at its end
            d = self.compute_time(a) + max(lag_f, lag_b)
            return d, d, d
        if key not in self.results:
            self.compute_time(a)
        res = self.results[key]
        if lag_f > 0 or lag_b > 0:
            # lags rounded *up* to 1 ns and priced at the rounded value: lags that differ by float noise share one
            # simulation, and rounding up never has a half start before its input
            lf, lb = math.ceil(lag_f * 1e3 - 1e-6) / 1e3, math.ceil(lag_b * 1e3 - 1e-6) / 1e3
            lkey = self._shape_key(a) + (lf, lb)
            res = self._lagged.get(lkey)
            if res is None:
                res = self._lagged[lkey] = self._run(self._chains(a), True, (lf, lb))
        f = self.slowdown
        return res.makespan * f, res.release[0] * f, res.release[1] * f

    @property
    def message_bytes(self) -> float:
        carry = self.spec.carry_bytes if self.width == self.spec.width else 0  # mhc-sp's coefficient
        return comm.boundary_bytes(self.shape.T, self.width, self.shape.C, self.shape.d) + self.shape.T * carry

    def transfer_time(self, a: Action) -> float:
        if self.opt.unit_costs:
            return 0.0
        if self.profile_pricing is not None:
            return self.profile_pricing.transfer_us(self)
        return comm.p2p_us(self.link, self.message_bytes)

    def simulate(self, schedule: Schedule, validate: bool = True, record: bool = True) -> SimResult:
        """`validate=False`: `schedule` was checked before (schedules.validate.check_structure's lowered result);
        `record=False`: no spans in the trace (schedules.simulate)."""
        if self.profile_pricing is not None and not self.opt.unit_costs:
            return self.profile_pricing.simulate(self, schedule)
        kw = dict(compute_time=self.compute_time, transfer_time=self.transfer_time, fb_timing=self.fb_timing,
                  p2p=self.opt.p2p, validate=validate, record=record)
        result = simulate(schedule, **kw)
        cores = self.hw.host_cores
        if cores and schedule.num_ranks > cores:  # CPU ranks sharing cores: stretch by the mean concurrency
            concurrency = sum(result.busy.values()) / result.makespan if result.makespan else 1.0
            self.slowdown = max(1.0, concurrency / cores)
            if self.slowdown > 1.0:
                self.results, self._lagged = {}, {}
                result = simulate(schedule, **kw)
        return result
