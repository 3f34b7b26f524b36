"""The road from the model's roofline to a published training throughput (`mhcpipe predict --explain` on a config
with one: DeepSeek-V3's), one factor at a time, each with its value and its source; what the model cannot name is
left as the unexplained rest. Nothing here is fitted to the published figure.

DeepSeek-V3 (arXiv 2412.19437): pre-training took 2,664K H800 GPU hours for 14.8T tokens (Table 1, §1; "180K H800
GPU hours per trillion tokens"), i.e. 1,543 tokens/s per GPU, context extension and post-training excluded. Its
batch grew from 3,072 to 15,360 sequences over the first 469B tokens (§4.2); it had no irrecoverable loss spikes and
no rollbacks (§1). Unpublished: expert load imbalance, stragglers, checkpoint time, restarts after failures.

The rungs, baseline residual (the published run had no mHC), in tokens/s per GPU:
1. the model's FLOPs at the dense bf16 peak (MFU 100%, the causal convention of `predict`);
2. every action as priced, spread evenly over the ranks, no bubble: one replica's rank-time / P (kernel rates
   and all-to-all exposure inside the actions);
3. + stage imbalance: the busiest rank's busy time;
4. + pipeline bubble: one replica's pipeline (the busiest rank's idle time added);
5. + exposed gradient reduction: `predict`'s step (its headline);
6. + optimizer step: AdamW over the busiest rank's shard of the states, HBM-bound (30 bytes per parameter of
   the shard: reads fp32 master, m, v and gradient, writes master, m, v and the bf16 copy), not overlapped;
7. x batch ramp: the ramp's tokens priced at their batch sizes (a linear ramp in tokens, 5 points, each at the
   nearest batch the layout accepts when the schedule refuses a smaller one: optimistic there);
then the published figure and the ratio left unexplained.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from configs import RunConfig
from costmodel.physics.ops import forward_flops_per_token


@dataclass(frozen=True)
class Published:
    """A published training run's throughput and what its paper says about the run around it."""

    tokens: float
    gpu_hours: float
    source: str
    ramp: tuple[int, int, float] | None = None  # (first batch, last batch, tokens over which it grows)
    ramp_source: str = ""
    notes: tuple[str, ...] = ()

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens / (self.gpu_hours * 3600)


PUBLISHED = {
    "deepseek-v3": Published(
        tokens=14.8e12, gpu_hours=2.664e6,
        source="DeepSeek-V3 (arXiv 2412.19437) Table 1 / §1: 2,664K H800 GPU hours of pre-training for 14.8T tokens",
        ramp=(3072, 15360, 469e9), ramp_source="DeepSeek-V3 §4.2: batch 3,072 -> 15,360 over the first 469B tokens",
        notes=("rollbacks: none (DeepSeek-V3 §1: no irrecoverable loss spikes, no rollbacks)",
               "expert load imbalance: not published (auxiliary-loss-free balancing, §2.1.2; the model prices "
               "perfectly balanced routing)",
               "stragglers, checkpoint saves, restarts after hardware failures, evaluation: not published")),
}


@dataclass
class Rung:
    name: str
    tokens_per_s_per_gpu: float
    source: str


@dataclass
class Road:
    config: str
    hardware: str
    rungs: list[Rung]
    published: Published
    unexplained: float  # the last rung over the published figure
    notes: list[str] = field(default_factory=list)


def published_for(cfg: RunConfig) -> Published | None:
    return PUBLISHED.get(cfg.model.name)


def road(cfg: RunConfig, hw, options, predict_fn) -> Road | None:
    """The road for `cfg` on `hw` (None when no published figure is known for its model); `predict_fn(cfg)` is
    `predict` with the caller's hardware and options, baseline and summary wanted."""
    pub = published_for(cfg)
    if pub is None:
        return None
    pred = predict_fn(cfg)
    s, sim, pricer = pred.summary, pred.baseline, pred.pricers["baseline"]
    par = cfg.parallel
    tokens, gpus, P = s["tokens_per_step"], s["gpus"], par.ranks

    def tps(us: float) -> float:
        return tokens / (us * 1e-6) / gpus

    rungs = [Rung("the model's FLOPs at the dense bf16 peak (MFU 100%)",
                  hw.peak("bf16") / (3 * forward_flops_per_token(cfg)), "costmodel/physics/ops.py")]
    mean_busy = statistics.fmean(sim.busy.values())
    rungs.append(Rung("every action as priced, spread evenly, no bubble", tps(mean_busy),
                      "kernel rates (hardware.py) and all-to-all exposure inside the actions"))
    rungs.append(Rung("+ stage imbalance (the busiest rank)", tps(max(sim.busy.values())),
                      f"busiest/mean {s['rank_busy_max_over_mean']['baseline']:.3f}, blocks per stage "
                      f"{s['stage_blocks']}"))
    rungs.append(Rung("+ pipeline bubble", tps(s["pipeline_us"]["baseline"]),
                      f"{par.schedule} P={P}, M={par.microbatches_per_replica} per replica"))
    step = s["iteration_us"]["baseline"]
    rungs.append(Rung("+ exposed gradient reduction (predict's step)", tps(step), "data_parallel.py"))
    opt_us = optimizer_us(cfg, hw, pricer, pred.schedule)
    rungs.append(Rung("+ optimizer step", tps(step + opt_us),
                      f"{opt_us / 1e3:.1f} ms: AdamW over the busiest rank's state shard at HBM speed"))
    last = step + opt_us
    if pub.ramp is not None:
        factor, note = ramp_factor(cfg, pub, predict_fn, step)
        rungs.append(Rung("x batch ramp", tps(last * factor), f"{pub.ramp_source}; {note}"))
        last *= factor
    final = tps(last)
    return Road(cfg.model.name, hw.name, rungs, pub, final / pub.tokens_per_s_per_gpu, list(pub.notes))


def optimizer_us(cfg: RunConfig, hw, pricer, schedule) -> float:
    """AdamW on the rank holding the most parameters: 30 bytes per parameter of its shard (module docstring)."""
    D, ep = cfg.parallel.data_parallel, cfg.parallel.expert_parallel
    dist = cfg.train.distributed_optimizer
    best = 0.0
    for r in range(schedule.num_ranks):
        stages = schedule.stages_of(r)
        dense = sum(pricer.stage_mem[st].params - pricer.stage_mem[st].expert_params for st in stages)
        experts = sum(pricer.stage_mem[st].expert_params for st in stages)
        shard = dense / D + experts / max(1, D // ep) if dist else dense + experts
        best = max(best, shard)
    return hw.memory_us(30 * best) + hw.launch_us


def ramp_factor(cfg: RunConfig, pub: Published, predict_fn, step_us: float) -> tuple[float, str]:
    """The whole run's time over the time at the final batch: the ramp's tokens (linear in tokens from the first
    batch to the last) priced at 5 batch sizes by trapezoids in time per token."""
    first, last, ramp_tokens = pub.ramp
    par = cfg.parallel
    D = par.data_parallel
    full_per_token = step_us / (par.microbatches * par.tokens_per_microbatch)
    per_token, used = [], []
    for b in (first + (last - first) * k / 4 for k in range(5)):
        m = max(1, round(b / D)) * D
        while True:
            try:
                c = cfg.model_copy(update={"parallel": par.model_copy(update={"microbatches": m})})
                RunConfig.model_validate(c.model_dump())
                pred = predict_fn(c)
                break
            except ValueError:
                m += D  # the schedule refuses this many micro-batches: the next batch it accepts
                if m > par.microbatches:
                    raise
        used.append(m)
        s = pred.summary
        per_token.append(s["iteration_us"]["baseline"] / s["tokens_per_step"])
    mean_ramp = sum((a + b) / 2 for a, b in zip(per_token, per_token[1:])) / (len(per_token) - 1)
    factor = (ramp_tokens * mean_ramp + (pub.tokens - ramp_tokens) * full_per_token) / (pub.tokens * full_per_token)
    note = (f"{ramp_tokens / pub.tokens:.1%} of the tokens at batches {', '.join(f'{u:,}' for u in used)} "
            f"(ramp {mean_ramp / full_per_token:.3f}x the final time per token)")
    return factor, note


def format_road(r: Road) -> str:
    pub = r.published.tokens_per_s_per_gpu
    lines = [f"  the road to the published throughput ({r.config} on {r.hardware}, baseline residual, tokens/s per "
             "GPU; nothing fitted):"]
    for g in r.rungs:
        lines.append(f"    {g.name:<52}{g.tokens_per_s_per_gpu:>9,.0f}   ({g.source})")
    lines.append(f"    {'published':<52}{pub:>9,.0f}   ({r.published.source})")
    lines.append(f"    unexplained: the model's road ends {r.unexplained:.3f}x the published figure "
                 f"({100 * (r.unexplained - 1):+.1f}%); not in the model:")
    lines += [f"      {n}" for n in r.notes]
    return "\n".join(lines)


def to_json(r: Road) -> dict:
    return {"config": r.config, "hardware": r.hardware,
            "rungs": [{"name": g.name, "tokens_per_s_per_gpu": g.tokens_per_s_per_gpu, "source": g.source}
                      for g in r.rungs],
            "published": {"tokens_per_s_per_gpu": r.published.tokens_per_s_per_gpu, "source": r.published.source},
            "unexplained_ratio": r.unexplained, "not_in_the_model": r.notes,
            "finite": all(math.isfinite(g.tokens_per_s_per_gpu) for g in r.rungs)}
