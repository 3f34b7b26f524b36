"""torchrun entry: `torchrun --nproc-per-node 4 -m pipeline --config configs/tiny.yaml --schedule dualpipev
--trace-dir runs/x`. With `--interleave residual:1` the same job also trains the baseline, one step of each in
turn (pipeline.train.train_interleaved), and writes runs/x/mhc_4/ and runs/x/residual_1/.

Layout: world = pipeline ranks (--pp) x data-parallel replicas (--dp), expert parallelism (--ep) inside dp
(pipeline.layout); without --pp the pipeline takes world / dp ranks. Several nodes: the same command on each,
with torchrun's --nnodes and rendezvous flags. Reads RANK / WORLD_SIZE / LOCAL_RANK (and LOCAL_WORLD_SIZE) from
torchrun. Backend: NCCL when every rank has its own GPU, gloo on CPU, and gloo with the host-staged transport
when several ranks share a GPU (or with --transport host). Bad flags, config or layout: one line on stderr,
exit 2, before any rank computes. A distributed failure (timeout, dead peer): one line naming the rank, the op
and the peer, exit 1, without tearing the group down (that can hang with a dead peer).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="tiny", help="YAML path or preset name in configs/ (default tiny)")
    p.add_argument("--schedule", choices=["gpipe", "1f1b", "zb1p", "dualpipe", "dualpipev"], help="parallel.schedule")
    p.add_argument("--microbatches", type=int, help="parallel.microbatches: of the global batch (split over --dp)")
    p.add_argument("--pp", type=int, help="parallel.ranks: pipeline ranks (default: processes / --dp)")
    p.add_argument("--dp", type=int, help="parallel.data_parallel: data-parallel replicas of the pipeline")
    p.add_argument("--ep", type=int, help="parallel.expert_parallel: ranks of dp that split each stage's experts")
    p.add_argument("--cpu-bind", action="store_true",
                   help="CPU runs: bind local rank i to core i mod cores (train.cpu_bind; pipeline/cpu_binding.py)")
    p.add_argument("--no-overlap", action="store_true",
                   help="run F&B pairs as forward then backward (parallel.overlap false), for A/B measurements")
    p.add_argument("--steps", type=int, help="train.steps")
    p.add_argument("--residual", help="residual variant and n, e.g. 'mhc:4' or 'residual:1'")
    p.add_argument("--recompute", help="'off', 'auto' or a block size in sub-layers")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="train.device")
    p.add_argument("--timeout", type=float, help="train.timeout_s (every P2P wait and collective)")
    p.add_argument("--transport", choices=["auto", "host"], default="auto",
                   help="'host' = stage P2P through host memory (several ranks on one GPU)")
    p.add_argument("--trace-dir", type=Path, help="write per-rank spans and the merged trace.json here")
    p.add_argument("--checkpoint-dir", type=Path,
                   help="write a checkpoint here after every step (DCP, by parameter name: any layout resumes it; "
                        "pipeline/checkpoint.py)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint-dir")
    p.add_argument("--interleave", metavar="VARIANT:N",
                   help="also train this residual (e.g. residual:1), one step of each in turn (A B B A ...): an "
                        "A/B measurement of the residual's cost in which both see the same machine state; "
                        "traces go to TRACE_DIR/<variant>_<n>/")


def _positive(flag: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"--{flag} {value}: must be >= 1")


def config_from_args(args: argparse.Namespace, world: int | None):
    """The run's config from the file and the flags; `world` (processes started), when known, sets the pipeline
    ranks if --pp is not given (world / data_parallel) and must equal pp x dp."""
    from configs import load_config, load_config_data
    from .layout import Layout

    for flag in ("pp", "dp", "ep", "microbatches", "steps"):
        _positive(flag, getattr(args, flag))
    over: dict = {"parallel": {}, "train": {}, "model": {}}
    if args.schedule:
        over["parallel"]["schedule"] = args.schedule
    if args.microbatches:
        over["parallel"]["microbatches"] = args.microbatches
    if args.dp:
        over["parallel"]["data_parallel"] = args.dp
    if args.ep:
        over["parallel"]["expert_parallel"] = args.ep
    if args.no_overlap:
        over["parallel"]["overlap"] = False
    if args.cpu_bind:
        over["train"]["cpu_bind"] = True
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
    if args.steps:
        over["train"]["steps"] = args.steps
    if args.device:
        over["train"]["device"] = args.device
    if args.timeout:
        over["train"]["timeout_s"] = args.timeout
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
    Layout.of(cfg).check(cfg, world)
    return cfg


def with_residual_flag(cfg, flag: str, value: str):
    """cfg with the residual a VARIANT:N flag names, validated like a config file."""
    from configs import parse_config

    variant, _, n = value.partition(":")
    if not n.isdigit():
        raise ValueError(f"{flag} {value!r}: use VARIANT:N, e.g. mhc:4 or residual:1")
    try:
        return parse_config(cfg.with_residual(variant, int(n)).model_dump())
    except Exception as err:  # pydantic error -> one line naming the field
        first = err.errors()[0]["msg"] if hasattr(err, "errors") else str(err)
        raise ValueError(f"{flag}: model.residual: {first}") from None


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
    from .checkpoint import resume_meta

    resume_meta(Path(args.checkpoint_dir), cfg)


def variant_dir(trace_dir: Path, cfg) -> Path:
    """TRACE_DIR/<variant>_<n>: where an interleaved variant's trace goes."""
    return Path(trace_dir) / f"{cfg.model.residual.variant}_{cfg.model.residual.n}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__.splitlines()[0])
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("python -m pipeline: error: not started by torchrun (RANK/WORLD_SIZE unset); "
              "use `torchrun --nproc-per-node P -m pipeline ...` or `mhcpipe run ...`", file=sys.stderr)
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    try:
        cfg = config_from_args(args, world)
        cfgs = interleaved_configs(cfg, args)
        check_resume(cfg, args)
    except ValueError as err:
        # every rank reports: torchrun may kill rank 0 before it prints once another rank has exited
        print(f"python -m pipeline: error (rank {rank}): {err}", file=sys.stderr, flush=True)
        return 2

    import torch

    from .p2p import PipelineError, init_distributed
    from .train import pick_device, train, train_interleaved

    try:
        device = pick_device(cfg, local_rank)
        staged = args.transport == "host"
        if device.type == "cuda":
            if local_world > torch.cuda.device_count():
                staged = True  # NCCL refuses two ranks on one GPU
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" and not staged else "gloo"
        init_distributed(backend, cfg.train.timeout_s)
        log = lambda line: print(line, flush=True)  # noqa: E731
        if len(cfgs) > 1:
            dirs = None if args.trace_dir is None else [variant_dir(args.trace_dir, c) for c in cfgs]
            train_interleaved(cfgs, rank, world, device, trace_dirs=dirs, staged=staged, log=log)
        else:
            train(cfg, rank, world, device, trace_dir=args.trace_dir, checkpoint_dir=args.checkpoint_dir,
                  resume=args.resume, staged=staged, log=log)
    except PipelineError as err:
        print(f"mhcpipe: error: {err}", file=sys.stderr, flush=True)
        os._exit(1)
    except ValueError as err:
        print(f"python -m pipeline: error (rank {rank}): {err}", file=sys.stderr, flush=True)
        os._exit(2)
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Skip interpreter finalization: on a loaded host it aborted a rank now and then ("terminate called without
    # an active exception", 2 of 49 runs on 2 busy vCPUs) after destroy_process_group had returned and the run
    # had written everything; torchrun then reports the whole run failed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
