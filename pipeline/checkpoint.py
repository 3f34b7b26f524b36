"""Checkpoints: one file per stage (parameters and their AdamW state, by model parameter name), atomic writes.

Layout of a checkpoint directory:
    stage<s>.pt    {"step": k, "stage": s, "params": {name: tensor}, "optim": {name: {step, exp_avg, exp_avg_sq}}}
                   (stage<s>.ep<e>.pt with expert parallelism: the dense parameters and EP rank e's experts)
    latest.json    {"step": k, "schedule": ..., "ranks": P, "data_parallel": D, "expert_parallel": EP,
                    "stages": S}   (written by rank 0 after all stages)

Data-parallel replicas hold the same parameters after the gradient all-reduce, so only the first replica of each
expert shard writes (dp rank < EP); a resumed run must have the same layout (pp, dp, ep).

Every file is written to a temporary name in the same directory and renamed (`os.replace`), so a crash leaves
either the previous checkpoint or the new one, never a torn file; latest.json moves last, after a barrier.
`load` returns the step to continue from (k + 1). DualPipe's two copies of a chunk are both saved (they are
identical after the mirrored reduction) so that every rank loads only its own stages.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from .p2p import collective


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


def stage_file(directory: Path, stage: int, ep: int, ep_rank: int) -> Path:
    return directory / (f"stage{stage}.pt" if ep == 1 else f"stage{stage}.ep{ep_rank}.pt")


def save(directory: Path, rt, step: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    opt_state = rt.optimizer.state
    g = rt.groups
    writer = g.dp_rank < g.layout.ep  # the first replica of each EP shard
    for s, stage in (rt.stages.items() if writer else ()):
        params, optim = {}, {}
        for name, p in stage.named_parameters():
            params[name] = p.detach().cpu()
            if p in opt_state:
                optim[name] = {k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in opt_state[p].items()}
        blob = {"step": step, "stage": s, "params": params, "optim": optim}
        _atomic_write(stage_file(directory, s, g.layout.ep, g.ep_rank), lambda t, blob=blob: torch.save(blob, t))
    world = g.world_group
    collective(dist.barrier, what="the checkpoint barrier", rank=rt.rank, timeout_s=rt.timeout_s, group=world)
    if rt.rank == 0:
        par = rt.cfg.parallel
        meta = {"step": step, "schedule": par.schedule, "ranks": par.ranks, "data_parallel": par.data_parallel,
                "expert_parallel": par.expert_parallel, "stages": rt.plan.schedule.num_stages}
        _atomic_write(directory / "latest.json", lambda t: t.write_text(json.dumps(meta)))
    collective(dist.barrier, what="the checkpoint barrier", rank=rt.rank, timeout_s=rt.timeout_s, group=world)


def resume_meta(directory: Path, cfg) -> dict:
    """latest.json of the checkpoint a run of `cfg` resumes from, checked against the run before any process
    group exists: present, same schedule and ranks, and steps left to train (train.steps counts from step 0)."""
    latest = directory / "latest.json"
    if not latest.exists():
        raise ValueError(f"--resume: no checkpoint in {directory} (latest.json missing)")
    meta = json.loads(latest.read_text())
    par = cfg.parallel
    was = (meta["schedule"], meta["ranks"], meta.get("data_parallel", 1), meta.get("expert_parallel", 1))
    now = (par.schedule, par.ranks, par.data_parallel, par.expert_parallel)
    if was != now:
        raise ValueError(f"--resume: checkpoint was written by schedule={was[0]}, --pp {was[1]}, --dp {was[2]}, "
                         f"--ep {was[3]}; this run has schedule={now[0]}, --pp {now[1]}, --dp {now[2]}, --ep {now[3]} "
                         "(resuming on another layout is not supported yet)")
    done = int(meta["step"]) + 1
    if done >= cfg.train.steps:
        raise ValueError(f"--resume: the checkpoint in {directory} has trained {done} steps and train.steps is "
                         f"{cfg.train.steps}: nothing left to run; raise --steps (it counts from step 0)")
    return meta


def load(directory: Path, rt) -> int:
    """Load this rank's stages; returns the next step to run."""
    meta = resume_meta(directory, rt.cfg)
    g = rt.groups
    for s, stage in rt.stages.items():
        blob = torch.load(stage_file(directory, s, g.layout.ep, g.ep_rank), map_location=rt.device, weights_only=True)
        if blob["step"] != meta["step"]:
            raise ValueError(f"--resume: stage{s}.pt is from step {blob['step']}, latest.json says {meta['step']}")
        named = dict(stage.named_parameters())
        missing = set(named) ^ set(blob["params"])
        if missing:
            raise ValueError(f"--resume: stage{s}.pt does not match the model (parameters {sorted(missing)[:3]}...)")
        with torch.no_grad():
            for name, p in named.items():
                p.copy_(blob["params"][name])
                if name in blob["optim"]:
                    rt.optimizer.state[p] = {k: (v.to(rt.device) if torch.is_tensor(v) and k != "step" else v)
                                             for k, v in blob["optim"][name].items()}
    return int(meta["step"]) + 1
