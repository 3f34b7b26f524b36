"""The runtime profile: what a `local` hardware spec carries when it was calibrated for this runtime and one
config, and the rule that says which configs it applies to.

This is data only. costmodel.local measures and fits it (calibration.py, runtime_fit.py) and prices actions
from it (host_pricing.py); the analytic core reads it to decide whether the roofline or the profile prices a
prediction (costmodel.pricing.pricer).
"""
from __future__ import annotations

import pydantic
from pydantic import BaseModel, ConfigDict, Field

# the residual's extra cost pieces a profile holds per residual, per sub-layer: the extra F, I, W and B work
# (fwd, bwd, w, b), the recompute rebuild (rc), and the stack ends
RESIDUAL_PIECES = ("fwd", "bwd", "w", "b", "rc", "expand_fwd", "expand_bwd", "contract_fwd", "contract_bwd")


class RuntimeProfile(BaseModel):
    """Calibration of *this runtime* on `local` for one model shape (costmodel.local.calibration).

    On a CPU the runtime's actions cost per-op overheads (Python executor, autograd, saved-tensor hooks, many small
    torch ops) that a FLOP/byte roofline does not see, and the ranks share fewer cores than there are ranks. So
    `local` carries, for one shape (fitted by costmodel.local.runtime_fit on a measured baseline run):
    * `cores_by_concurrency`: cores(k), the measured throughput of k concurrent single-thread ranks in units of one
      alone (costmodel.local.core_sharing). `time_slice_us`: the OS time slice among more busy ranks than cores,
      the scheduler tick (measured); `protect_us`: how long a rank that got a core keeps it before a tick may take
      it (measured). costmodel.local.shared_cores schedules the ranks on the cores that way along the schedule;
      what more busy ranks than cores lose (cores(k) falls below the cores' count) is lost at the switches.
      With no slice, every computing rank progresses at min(1, cores(k) / k).
    * `action_us`: full-speed work of every baseline (n = 1) action, keyed "F/s3", "I/s3", "W/s3", "B/s3",
      "FB/s3+s4": the work whose shared-cores simulation reproduces the measured durations (their median
      over the steady steps). Reusing them for the baseline is replay, not prediction.
    * `residual_us`: extra cost of a residual over the plain one inside the pipeline, per sub-layer, keyed
      "variant:n" (e.g. "mhc:4"), one value per RESIDUAL_PIECES. Micro-benchmarked on the runtime's own stage
      (pipeline.launch.host_measurements) and scaled by the in-pipeline factor of its kind measured on the baseline run
      (costmodel.local.runtime_fit).
    * `action_overhead_us`: the executor's full-speed work before each compute action (posting comm, reaping
      sends, recording).
    * `p2p_latency_us`: effective latency of one stage-boundary message in the runtime (gloo progress, the
      wake-up of a descheduled receiver, an executor preempted between two actions): the value for which the
      simulated baseline step equals the measured one.
    """

    model_config = ConfigDict(extra="forbid")
    key: dict = Field(description="the shape this profile applies to (runtime_key)")
    action_us: dict[str, float] = Field(description="full-speed work of the baseline actions, 'F/s3', 'FB/s3+s4'")
    residual_us: dict[str, dict[str, float]] = Field(default_factory=dict,
                                                     description="per residual 'variant:n': extra us per sub-layer")
    action_overhead_us: float = Field(0.0, ge=0, description="full-speed executor work before each compute action")
    p2p_latency_us: float = Field(0.0, ge=0, description="effective latency of one stage-boundary message")
    cores_by_concurrency: list[float] = Field(min_length=1, description="cores(k) for k = 1, 2, ... ranks computing "
                                                                        "at once; the last value holds beyond")
    time_slice_us: float = Field(0.0, ge=0, description="the OS time slice among more ranks than cores "
                                                        "(core_sharing.measure_time_slice); 0 = fluid sharing, "
                                                        "else ranks scheduled on the cores, preempted at "
                                                        "this scheduler tick")
    protect_us: float = Field(0.0, ge=0, description="how long a rank that takes a core runs before a tick may "
                                                     "preempt it (core_sharing.measure_protection)")
    meta: dict = Field(default_factory=dict)

    @pydantic.field_validator("residual_us")
    @classmethod
    def _all_pieces(cls, v: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        for key, pieces in v.items():
            missing = [p for p in RESIDUAL_PIECES if p not in pieces]
            if missing:
                raise ValueError(f"residual_us[{key!r}] lacks {', '.join(missing)} (a profile from an older "
                                 "calibration); recalibrate `local` (mhcpipe demo, or calibrate_local_for)")
        return v

    @pydantic.field_validator("cores_by_concurrency")
    @classmethod
    def _positive(cls, v: list[float]) -> list[float]:
        if any(c <= 0 for c in v):
            raise ValueError(f"every cores(k) must be > 0, got {v}")
        return v


def runtime_key(cfg) -> dict:
    """What the per-action costs depend on: model shape, tokens per micro-batch, layout, recompute, dtype."""
    m, p = cfg.model, cfg.parallel
    return {"model": {"vocab_size": m.vocab_size, "num_blocks": m.num_blocks, "hidden": m.hidden,
                      "num_heads": m.num_heads, "head_dim": m.head_dim, "mlp_hidden": m.mlp_hidden,
                      "moe": None if m.moe is None else m.moe.model_dump()},
            "tokens_per_microbatch": p.tokens_per_microbatch, "seq_len": p.seq_len, "schedule": p.schedule,
            "ranks": p.ranks, "recompute": cfg.recompute.model_dump(), "dtype": cfg.train.dtype}


def profile_for(hw, cfg) -> RuntimeProfile | None:
    """The hardware's runtime profile when it was calibrated for this config's shape (else None: roofline)."""
    prof = hw.runtime
    if prof is None:
        return None
    return prof if prof.key == runtime_key(cfg) else None
