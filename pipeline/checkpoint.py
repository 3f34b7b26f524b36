"""Checkpoints: one file per stage (parameters and their AdamW state, by model parameter name), atomic writes.

Layout of a checkpoint directory:
    stage<s>.pt    {"step": k, "stage": s, "params": {name: tensor}, "optim": {name: {step, exp_avg, exp_avg_sq}}}
    latest.json    {"step": k, "schedule": ..., "ranks": P, "stages": S}   (written by rank 0 after all stages)

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


def save(directory: Path, rt, step: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    opt_state = rt.optimizer.state
    for s, stage in rt.stages.items():
        params, optim = {}, {}
        for name, p in stage.named_parameters():
            params[name] = p.detach().cpu()
            if p in opt_state:
                optim[name] = {k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in opt_state[p].items()}
        blob = {"step": step, "stage": s, "params": params, "optim": optim}
        _atomic_write(directory / f"stage{s}.pt", lambda t, blob=blob: torch.save(blob, t))
    collective(dist.barrier, what="the checkpoint barrier", rank=rt.rank, timeout_s=rt.timeout_s)
    if rt.rank == 0:
        par = rt.cfg.parallel
        meta = {"step": step, "schedule": par.schedule, "ranks": par.ranks, "stages": rt.plan.schedule.num_stages}
        _atomic_write(directory / "latest.json", lambda t: t.write_text(json.dumps(meta)))
    collective(dist.barrier, what="the checkpoint barrier", rank=rt.rank, timeout_s=rt.timeout_s)


def resume_meta(directory: Path, cfg) -> dict:
    """latest.json of the checkpoint a run of `cfg` resumes from, checked against the run before any process
    group exists: present, same schedule and ranks, and steps left to train (train.steps counts from step 0)."""
    latest = directory / "latest.json"
    if not latest.exists():
        raise ValueError(f"--resume: no checkpoint in {directory} (latest.json missing)")
    meta = json.loads(latest.read_text())
    par = cfg.parallel
    if meta["schedule"] != par.schedule or meta["ranks"] != par.ranks:
        raise ValueError(f"--resume: checkpoint was written by schedule={meta['schedule']}, ranks={meta['ranks']}; "
                         f"this run has parallel.schedule={par.schedule}, parallel.ranks={par.ranks}")
    done = int(meta["step"]) + 1
    if done >= cfg.train.steps:
        raise ValueError(f"--resume: the checkpoint in {directory} has trained {done} steps and train.steps is "
                         f"{cfg.train.steps}: nothing left to run; raise --steps (it counts from step 0)")
    return meta


def load(directory: Path, rt) -> int:
    """Load this rank's stages; returns the next step to run."""
    meta = resume_meta(directory, rt.cfg)
    for s, stage in rt.stages.items():
        blob = torch.load(directory / f"stage{s}.pt", map_location=rt.device, weights_only=True)
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
