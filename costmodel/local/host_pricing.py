"""Pricing from the runtime profile of a `local` spec (costmodel.physics.runtime_profile): the ProfilePricing that
costmodel.pricing.pricer.Pricer hands an action to when the hardware was calibrated for this runtime and config.

A baseline action is its fitted full-speed work (replay of the calibration run); a residual's action is that
plus sub-layers x the residual's micro-benchmarked extra cost of the action's kind (and of the recompute
rebuild and the stack ends where the stage has them). A stage-boundary message takes the fitted latency plus
its bytes over the measured link. The schedule is simulated on ranks sharing the host's cores in time slices
(shared_cores.py).
"""
from __future__ import annotations

import statistics

from costmodel.local.shared_cores import simulate_shared
from schedules.ir import Action, Kind, Schedule
from schedules.simulate import SimResult


class HostPricing:
    """costmodel.pricing.pricer.ProfilePricing for a `local` spec calibrated for this runtime (see the module
    docstring).
    Stateless: everything it reads is on the Pricer (`pricer.runtime` is the profile)."""

    def compute_us(self, pricer, a: Action) -> float:
        k = a.kind
        if k in (Kind.F, Kind.I, Kind.W, Kind.B):
            return _base_action(pricer, f"{k.value}/s{a.stage}", k.value) + _extra_us(pricer, a.stage, k.value)
        if k is Kind.FB:
            key = f"FB/s{a.stage}+s{a.b_stage}"
            if key in pricer.runtime.action_us:
                base = pricer.runtime.action_us[key]
            else:  # an F&B pair the baseline never ran: its two halves back to back
                base = _base_action(pricer, f"F/s{a.stage}", "F") + _base_action(pricer, f"B/s{a.b_stage}", "B")
            return base + _extra_us(pricer, a.stage, "F") + _extra_us(pricer, a.b_stage, "B")
        raise ValueError(f"cannot price action kind {k}")

    def transfer_us(self, pricer) -> float:
        """The fitted in-situ latency plus the message's bytes over the measured link."""
        link = pricer.link
        return pricer.runtime.p2p_latency_us + pricer.message_bytes / (link.bandwidth * link.efficiency) * 1e6

    def simulate(self, pricer, schedule: Schedule) -> SimResult:
        rt = pricer.runtime

        def fb_forward_share(a: Action) -> float:
            """The forward half's share of an F&B pair's work: the runtime runs a pair without communication
            inside its halves as its forward, then its backward, and sends the forward output in between."""
            f, pair = pricer.compute_time(Action(Kind.F, a.stage, a.mb)), pricer.compute_time(a)
            return min(1.0, f / pair) if pair > 0 else 0.0

        return simulate_shared(schedule, pricer.compute_time, pricer.transfer_time, rt.cores_by_concurrency,
                               rt.action_overhead_us, slice_us=rt.time_slice_us, protect_us=rt.protect_us,
                               fb_forward_share=fb_forward_share if pricer.cfg.parallel.overlap else None)


def _residual_extra(pricer) -> dict[str, float] | None:
    spec = pricer.spec
    if spec.is_baseline:
        return None
    key = f"{spec.variant}:{spec.n}"
    extra = pricer.runtime.residual_us.get(key)
    if extra is None:
        raise ValueError(f"hardware {pricer.hw.name!r}: its runtime profile has no micro-benchmark of residual "
                         f"{key} (has {', '.join(pricer.runtime.residual_us) or 'none'}); recalibrate with "
                         f"calibrate_local_for(cfg, ..., stage_us=time_stage_pieces(cfg, [('{spec.variant}', "
                         f"{spec.n})]))")
    return extra


def _base_action(pricer, key: str, kind: str) -> float:
    table = pricer.runtime.action_us
    if key in table:
        return table[key]
    same = [v for k, v in table.items() if k.startswith(kind + "/")]
    if same:
        return statistics.median(same)
    raise ValueError(f"runtime profile has no {kind} actions; recalibrate `local` for this schedule")


def _extra_us(pricer, stage: int, kind: str) -> float:
    """The residual's extra full-speed work in one F, I, W or B action of `stage` over the baseline's."""
    extra = _residual_extra(pricer)
    if extra is None:
        return 0.0
    blocks, first, last = pricer.layout[stage]
    subs = 2 * len(blocks)
    if kind == "F":
        return subs * extra["fwd"] + (extra["expand_fwd"] if first else 0.0) + \
            (extra["contract_fwd"] if last else 0.0)
    if kind == "W":
        return subs * extra["w"]
    t = subs * extra["b" if kind == "B" else "bwd"]
    if pricer.recompute and pricer.stage_mem[stage].recompute_block:
        t += subs * extra["rc"]
    return t + (extra["expand_bwd"] if first else 0.0) + (extra["contract_bwd"] if last else 0.0)
