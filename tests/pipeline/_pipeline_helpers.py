"""Shared helpers for tests/pipeline: tiny configs and comparisons (imported by the test modules)."""
from __future__ import annotations

import contextlib
import copy
import io
import json
import subprocess

import torch


def tiny_config(schedule: str, ranks: int, *, n: int = 4, recompute: dict | None = None, blocks: int | None = None,
                steps: int = 3, moe: bool = False, timeout_s: float = 20.0, seed: int = 1, dp: int = 1, ep: int = 1,
                overlap: bool = True, dtype: str = "float32", comm_rules: str = "nccl") -> dict:
    """Multi-rank runs go under NCCL's rules on gloo (`comm_rules` 'nccl': pipeline.distributed.strict_transport).
    hidden 32, 2 heads, seq 8, micro-batches of 2 sequences, M = 2P per data-parallel replica (the minimum
    DualPipe(V) accepts), dp replicas, EP ep; MoE: 4 experts, top-2, one shared expert, the first block dense."""
    model = {"name": "test", "vocab_size": 64, "num_blocks": blocks or (4 if ranks == 2 else 8), "hidden": 32,
             "num_heads": 2, "head_dim": 16, "mlp_hidden": 64,
             "residual": {"variant": "mhc" if n > 1 else "residual", "n": n}}
    if moe:
        model["moe"] = {"num_experts": 4, "top_k": 2, "num_shared": 1, "expert_hidden": 16, "first_dense_blocks": 1}
    return {"model": model,
            "parallel": {"schedule": schedule, "ranks": ranks, "microbatches": 2 * ranks * dp, "microbatch_size": 2,
                         "seq_len": 8, "data_parallel": dp, "expert_parallel": ep, "overlap": overlap},
            "recompute": recompute or {"mode": "off"},
            "train": {"steps": steps, "lr": 1e-2, "seed": seed, "device": "cpu", "timeout_s": timeout_s,
                      "dtype": dtype, "comm_rules": comm_rules}}


# what the single-process model does not read: the schedule and its F&B overlap, recompute (the single-process
# model has none), the transport's rules and deadline, and the step count (served from a longer run)
_NOT_READ = {"parallel": ("schedule", "overlap"), "train": ("comm_rules", "timeout_s", "steps")}
_REF_STEPS = 3
_references: dict[str, tuple] = {}


def single_process_reference(cfg_dict: dict, steps: int) -> tuple[list[float], dict, dict]:
    """pipeline.single_process.train_single_process of `cfg_dict` for `steps` (<= 3) steps: (losses, step-0 grads,
    params after 3 steps: callers use their names). One run per model, data and optimizer config in this process:
    the schedules, overlaps and recompute modes of one grid share it instead of training it again each."""
    from configs import parse_config
    from pipeline.single_process import train_single_process

    if steps > _REF_STEPS:
        raise ValueError(f"single_process_reference serves at most {_REF_STEPS} steps, not {steps}")
    key_dict = copy.deepcopy(cfg_dict)
    key_dict.pop("recompute", None)
    for section, fields in _NOT_READ.items():
        for f in fields:
            key_dict.get(section, {}).pop(f, None)
    key = json.dumps(key_dict, sort_keys=True)
    if key not in _references:
        cfg = parse_config(cfg_dict)
        _references[key] = train_single_process(cfg, steps=_REF_STEPS)
    losses, grads, params = _references[key]
    return losses[:steps], grads, params


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def merged_grads(results, variant: int) -> dict[str, torch.Tensor]:
    """Gradients of one variant over all ranks; copies (DualPipe's two, data-parallel replicas) must be bitwise
    identical after their all-reduce."""
    out: dict[str, torch.Tensor] = {}
    for r in results:
        for name, g in r.value[variant]["grads"].items():
            if name in out:
                assert torch.equal(out[name], g), f"the two copies of {name} differ after the mirrored reduction"
            out[name] = g
    return out


def assert_grads_match(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], param_names, tol: float,
                       what: str) -> None:
    """Every parameter of the single-process model (`param_names`) has a gradient on both sides (`want`: the
    single-process model's, `got`: the one under test), and each pair agrees: ||g - g_ref|| / ||g_ref|| <= tol.
    A parameter without a gradient on either side is an error naming it (one that never reaches the loss would
    otherwise drop out of the comparison unnoticed), and so is a gradient of a parameter the model lacks."""
    names = set(param_names)
    for side, grads in (("the single-process model", want), ("the run under test", got)):
        missing = sorted(names - set(grads))
        assert not missing, f"{what}: no gradient in {side} for {len(missing)} parameters: {missing[:5]}"
        extra = sorted(set(grads) - names)
        assert not extra, f"{what}: {side} has gradients of parameters the single-process model lacks: {extra[:5]}"
    for name in sorted(names):
        err = rel_err(got[name], want[name])
        assert err <= tol, f"{what}: grad {name} rel err {err:.2e}"


def check_ok(results) -> None:
    bad = [(r.rank, r.exitcode, r.error) for r in results if r.exitcode != 0 or r.error]
    assert not bad, f"ranks failed: {bad}"


def mhcpipe_in_process(*args: str) -> subprocess.CompletedProcess:
    """`mhcpipe ARGS` in this process, for a command that starts no process group: input it must refuse before it
    starts anything (a bad flag, config or layout), or a single-process command (`checkpoint convert`): its exit
    code and what it printed, as subprocess.run would return them. Saves starting an
    interpreter that imports torch per case; an exception that escapes `main` fails the test with its traceback,
    as a traceback on a real stderr would."""
    from mhcpipe.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(args))
        except SystemExit as stop:  # argparse's own errors
            rc = stop.code if isinstance(stop.code, int) else 2
    return subprocess.CompletedProcess(["mhcpipe", *args], rc, out.getvalue(), err.getvalue())
