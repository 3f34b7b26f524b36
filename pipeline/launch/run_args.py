"""The run's flags and the config they make, shared by `torchrun -m pipeline` (pipeline/__main__.py) and
`mhcpipe run` (mhcpipe/run_cli.py, which checks them once before it launches torchrun).

`add_run_arguments` declares the flags; `config_from_args` overlays them on the YAML config and checks the layout;
`interleaved_configs` adds the --interleave variant; `check_resume` checks --resume against the checkpoint folder;
`variant_dir` is where an interleaved variant's trace goes. Bad values raise ValueError with one line naming the
flag or field.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="tiny", help="YAML path or preset name in configs/ (default tiny)")
    p.add_argument("--schedule", choices=["gpipe", "1f1b", "zb1p", "dualpipe", "dualpipev"], help="parallel.schedule")
    p.add_argument("--microbatches", type=int, help="parallel.microbatches: of the global batch (split over --dp)")
    p.add_argument("--pp", type=int, help="parallel.ranks: pipeline ranks (default: processes / --dp)")
    p.add_argument("--dp", type=int, help="parallel.data_parallel: data-parallel replicas of the pipeline")
    p.add_argument("--ep", type=int, help="parallel.expert_parallel: ranks of dp that split each stage's experts")
    p.add_argument("--cpu-bind", action="store_true",
                   help="CPU runs: bind local rank i to core i mod cores (train.cpu_bind; "
                        "pipeline/runtime/cpu_binding.py)")
    p.add_argument("--no-overlap", action="store_true",
                   help="run F&B pairs as forward then backward (parallel.overlap false), for A/B measurements")
    p.add_argument("--steps", type=int, help="train.steps")
    p.add_argument("--residual", help="residual variant and n, e.g. 'mhc:4', 'mhc-sp:4', 'residual:1', or xHC's N:k "
                                                "'xhc:16:4'")
    p.add_argument("--expand", choices=["copy", "lss"],
                   help="model.residual.expand: stack entry, copies or LSS per-stream learned scaling")
    p.add_argument("--recompute", help="'off', 'auto' or a block size in sub-layers")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="train.device")
    p.add_argument("--timeout", type=float, help="train.timeout_s (every P2P wait and collective)")
    p.add_argument("--transport", choices=["auto", "host", "strict", "strict-pair"],
                   default=os.environ.get("MHCPIPE_TRANSPORT") or "auto",
                   help="default auto, or $MHCPIPE_TRANSPORT (the test suite sets strict). "
                        "'host' = stage P2P through host memory (several ranks on one GPU); 'strict' = gloo P2P "
                        "under NCCL's rules (a posting order that would hang on NCCL fails here with every rank's "
                        "queue heads; train.comm_rules nccl), 'strict-pair' = the same with one queue per rank pair")
    p.add_argument("--p2p-groups", choices=["channel", "shared"],
                   help="parallel.p2p_groups: 'channel' (default) = one process group per direction of each "
                        "pipeline link; 'shared' = one for all, the old design that deadlocks under NCCL (kept to "
                        "reproduce it with --transport strict and mhcpipe check-comm)")
    p.add_argument("--diagnostics-every", type=int, metavar="K",
                   help="train.diagnostics_every: log stream-collapse diagnostics on step 0, every K-th step and the "
                        "last, into --diagnostics-dir or --trace-dir (draw them with `mhcpipe diagnose`)")
    p.add_argument("--diagnostics-dir", type=Path,
                   help="where diagnostics_rank<r>.json go (default --trace-dir); without --trace-dir no spans are "
                        "recorded, so a run of hundreds of steps stays light")
    p.add_argument("--trace-dir", type=Path, help="write per-rank spans and the merged trace.json here")
    p.add_argument("--checkpoint-dir", type=Path,
                   help="write a checkpoint here after every step (DCP, by parameter name: any layout resumes it; "
                        "pipeline/checkpoint/dcp.py)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint-dir")
    p.add_argument("--interleave", metavar="VARIANT:N",
                   help="also train this residual (e.g. residual:1), one step of each in turn (A B B A ...): an "
                        "A/B measurement of the residual's cost in which both see the same machine state; "
                        "traces go to TRACE_DIR/<variant>_<n>/")


def _positive(flag: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"--{flag} {value}: must be >= 1")


# flag -> (config section, field, value to set; None = the flag's own value); `--pp` (which may come from the
# process count) and `--recompute` (parsed) are handled apart
_FLAG_FIELDS = {
    "schedule": ("parallel", "schedule", None),
    "microbatches": ("parallel", "microbatches", None),
    "dp": ("parallel", "data_parallel", None),
    "ep": ("parallel", "expert_parallel", None),
    "no_overlap": ("parallel", "overlap", False),
    "cpu_bind": ("train", "cpu_bind", True),
    "steps": ("train", "steps", None),
    "device": ("train", "device", None),
    "timeout": ("train", "timeout_s", None),
    "diagnostics_every": ("train", "diagnostics_every", None),
    "p2p_groups": ("parallel", "p2p_groups", None),
}
_TRANSPORT_RULES = {"strict": "nccl", "strict-pair": "nccl-pair"}  # --transport -> train.comm_rules


def config_from_args(args: argparse.Namespace, world: int | None):
    """The run's config from the file and the flags; `world` (processes started), when known, sets the pipeline
    ranks if --pp is not given (world / data_parallel) and must equal pp x dp."""
    from configs import load_config, load_config_data
    from pipeline.distributed.layout import Layout

    for flag in ("pp", "dp", "ep", "microbatches", "steps", "diagnostics_every"):
        _positive(flag, getattr(args, flag))
    over: dict = {"parallel": {}, "train": {}, "model": {}}
    for flag, (section, field, value) in _FLAG_FIELDS.items():
        given = getattr(args, flag, None)
        if given:  # unset flags (None, False, 0) keep the config's value
            over[section][field] = given if value is None else value
    if getattr(args, "transport", None) in _TRANSPORT_RULES:
        over["train"]["comm_rules"] = _TRANSPORT_RULES[args.transport]
    if args.pp:
        over["parallel"]["ranks"] = args.pp
    elif world is not None:
        data, _ = load_config_data(args.config, {k: v for k, v in over.items() if v})
        dp = (data.get("parallel") or {}).get("data_parallel", 1)
        if not isinstance(dp, int) or dp < 1:
            dp = 1  # the validation below names the bad field
        if world % dp:
            raise ValueError(f"parallel.data_parallel (--dp {dp}) does not divide the {world} processes started; "
                             "processes = --pp x --dp")
        over["parallel"]["ranks"] = world // dp
    if args.recompute:
        if args.recompute in ("off", "auto"):
            over["recompute"] = {"mode": args.recompute}
        elif args.recompute.isdigit():
            over["recompute"] = {"mode": "block", "block_size": int(args.recompute)}
        else:
            raise ValueError(f"--recompute {args.recompute!r}: use 'off', 'auto' or a block size")
    cfg = load_config(args.config, {k: v for k, v in over.items() if v})
    if args.residual:
        cfg = with_residual_flag(cfg, "--residual", args.residual)
    if getattr(args, "expand", None):
        from configs import parse_config

        data = cfg.model_dump()
        data["model"]["residual"]["expand"] = args.expand
        cfg = parse_config(data)
    Layout.of(cfg).check(cfg, world)
    if cfg.train.diagnostics_every and diagnostics_dir(args) is None:
        raise ValueError("--diagnostics-every (train.diagnostics_every) writes diagnostics_rank<r>.json into a "
                         "folder: add --diagnostics-dir DIR (or --trace-dir DIR)")
    return cfg


def with_residual_flag(cfg, flag: str, value: str):
    """cfg with the residual a VARIANT:N (xHC: xhc:N:K) flag names, validated like a config file."""
    from configs import parse_config

    variant, *nums = value.split(":")
    if not nums or len(nums) > 2 or not all(v.isdigit() for v in nums):
        raise ValueError(f"{flag} {value!r}: use VARIANT:N, e.g. mhc:4, mhc-sp:4 or residual:1 (xHC: xhc:N:K, "
                         "e.g. xhc:16:4 = 16 streams, 4 active)")
    if len(nums) == 2 and variant != "xhc":
        raise ValueError(f"{flag} {value!r}: only xhc takes N:K (K active streams); use {variant}:{nums[0]}")
    try:
        return parse_config(cfg.with_residual(variant, int(nums[0]), int(nums[1]) if len(nums) == 2 else None)
                            .model_dump())
    except Exception as err:  # pydantic error -> one line naming the field
        first = err.errors()[0]["msg"] if hasattr(err, "errors") else str(err)
        raise ValueError(f"{flag}: model.residual: {first}") from None


def diagnostics_dir(args: argparse.Namespace) -> Path | None:
    """Where the run's diagnostics go: --diagnostics-dir, else --trace-dir, else nowhere."""
    return getattr(args, "diagnostics_dir", None) or getattr(args, "trace_dir", None)


def interleaved_configs(cfg, args: argparse.Namespace) -> list:
    """[cfg] or, with --interleave, [cfg, the same with the other residual]; refuses what cannot be interleaved."""
    if not args.interleave:
        return [cfg]
    if args.checkpoint_dir is not None or args.resume:
        raise ValueError("--interleave measures two variants side by side; it does not checkpoint or resume "
                         "(drop --checkpoint-dir/--resume)")
    other = with_residual_flag(cfg, "--interleave", args.interleave)
    if other.model.residual == cfg.model.residual:
        raise ValueError(f"--interleave {args.interleave}: the run already uses that residual; name the other "
                         "variant, e.g. --residual mhc:4 --interleave residual:1")
    return [cfg, other]


def check_resume(cfg, args: argparse.Namespace) -> None:
    """--resume needs --checkpoint-dir holding a checkpoint of this run with steps left (checked before launch)."""
    if not args.resume:
        return
    if args.checkpoint_dir is None:
        raise ValueError("--resume needs --checkpoint-dir (the folder a run wrote with --checkpoint-dir)")
    from pipeline.checkpoint.dcp import resume_meta

    resume_meta(Path(args.checkpoint_dir), cfg)


def variant_dir(trace_dir: Path, cfg) -> Path:
    """TRACE_DIR/<variant>_<n> (xHC: xhc_<N>_<k>): where an interleaved variant's trace goes."""
    return Path(trace_dir) / cfg.model.residual.label.replace(":", "_")
