"""The search space of `tune` (costmodel/answers/tune.py): one `Candidate` per layout of a base config on a number of
GPUs for a global batch - P dividing the GPUs (D = GPUs / P), the schedule kind, EP dividing D and the expert count,
the micro-batch size, the recompute choice, the hp stream, the optimizer's sharding and how blocks are cut into
stages; layouts a schedule's own rules (through schedules.build), the block count or the batch refuse are counted and
dropped before anything is priced. See tune.py's docstring for what each choice means.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from configs import RunConfig
from schedules.build import build
from schedules.registry import kind_of, names


@dataclass(frozen=True)
class Candidate:
    """One layout: what the written YAML sets (parallel.*, recompute.*) plus the hp placement (a pricing
    switch: the runtime always runs post+res on the high-priority stream on CUDA)."""

    schedule: str
    pp: int
    dp: int
    ep: int
    microbatch_size: int
    microbatches: int  # M of the whole step (the config's parallel.microbatches)
    recompute: str  # "off", "auto" or a block size in sub-layers
    hp: bool = True
    uneven: bool = False
    distributed_optimizer: bool = False  # train.distributed_optimizer (ZeRO-1 over the data-parallel ranks)
    split: str = "even"  # how blocks are cut into stages: "even" or "balanced" (by cost; written as stage_split)

    @property
    def per_replica(self) -> int:
        return self.microbatches // self.dp

    def label(self) -> str:
        return (f"{self.schedule} pp={self.pp} dp={self.dp} ep={self.ep} mbs={self.microbatch_size} "
                f"M={self.microbatches} recompute={self.recompute}{'' if self.hp else ' no-hp'}"
                f"{' dist-opt' if self.distributed_optimizer else ''}"
                f"{' split=balanced' if self.split != 'even' else ''}")

    def overrides(self) -> dict:
        rc = ({"mode": self.recompute, "block_size": None} if self.recompute in ("off", "auto")
              else {"mode": "block", "block_size": int(self.recompute)})
        return {"parallel": {"schedule": self.schedule, "ranks": self.pp, "data_parallel": self.dp,
                             "expert_parallel": self.ep, "microbatches": self.microbatches,
                             "microbatch_size": self.microbatch_size, "uneven_stages": self.uneven,
                             "stage_split": None},  # Tuner.config writes a balanced candidate's cut
                "recompute": rc, "train": {"distributed_optimizer": self.distributed_optimizer}}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(cfg: RunConfig, gpus: int, global_batch: int, schedules=None, microbatch_sizes=(1, 2, 4),
               recompute=("off", "auto", "1", "2", "4", "8"), hp=(True, False), allow_uneven: bool = True,
               distributed_optimizer=(False, True), splits=("even",), counts: Counter | None = None,
               built: dict | None = None) -> list[Candidate]:
    """Every valid layout (the schedule's own M/P rules decide, through schedules.build). `built`: receives each
    schedule built to decide, by (kind, P, M per replica), for the caller to price (the tuner: not built twice)."""
    schedules = names() if schedules is None else schedules  # every registered kind (schedules.registry)
    counts = counts if counts is not None else Counter()
    nb, moe = cfg.model.num_blocks, cfg.model.moe
    out = []
    for pp in divisors(gpus):
        dp = gpus // pp
        for kind in schedules:
            stages = kind_of(kind).model_chunks(pp)
            if stages > nb:
                counts["more stages than blocks"] += 1
                continue
            uneven = nb % stages != 0
            if uneven and not allow_uneven:
                counts["uneven stages (--even-only)"] += 1
                continue
            for b in microbatch_sizes:
                if global_batch % b or (global_batch // b) % dp:
                    counts["global batch not divisible into micro-batches x dp"] += 1
                    continue
                M = global_batch // b
                try:
                    schedule = build(kind, pp, M // dp)
                except ValueError:
                    counts["schedule rules (M/P)"] += 1
                    continue
                if built is not None:
                    built[(kind, pp, M // dp)] = schedule
                eps = [e for e in divisors(dp) if moe is not None and moe.num_experts % e == 0] or [1]
                for ep in eps:
                    for rc in recompute:
                        for h in hp:
                            for zero in distributed_optimizer:
                                for split in splits:
                                    if split == "balanced" and not allow_uneven:
                                        counts["balanced split (--even-only)"] += 1
                                        continue
                                    out.append(Candidate(kind, pp, dp, ep, b, M, rc, h, uneven or split != "even",
                                                         zero, split))
    return out


def reference_candidate(cfg: RunConfig, gpus: int, global_batch: int) -> Candidate | None:
    """The config's own layout (schedule, P, EP, b, recompute) on `gpus` GPUs: D = gpus / P."""
    p, rc = cfg.parallel, cfg.recompute
    if gpus % p.ranks or global_batch % p.microbatch_size:
        return None
    dp = gpus // p.ranks
    M = global_batch // p.microbatch_size
    if M % dp or dp % p.expert_parallel:
        return None
    recompute = rc.mode if rc.mode != "block" else str(rc.block_size)
    uneven = cfg.model.num_blocks % p.num_stages != 0
    return Candidate(p.schedule, p.ranks, dp, p.expert_parallel, p.microbatch_size, M, recompute, True, uneven,
                     cfg.train.distributed_optimizer)
