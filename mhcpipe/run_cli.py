"""`mhcpipe run`: validate the config here, then launch torchrun's agent (torch.distributed.run) on this host.

    mhcpipe run --nproc 4 --config configs/tiny.yaml --schedule dualpipev --trace-dir runs/x

Every flag except --nproc is passed through to `python -m pipeline` (flags: pipeline/launch/run_args.py). A bad config
is reported here as one line (exit 2) before any process starts. The agent runs in this process (torch is imported
already: a `torchrun` process would import it again before the ranks start); when a rank fails, its own message
is on stderr, then one line here names the first failed rank, and its exit code is returned.
"""
from __future__ import annotations

import argparse
import sys

from pipeline.__main__ import add_run_arguments
from pipeline.launch.run_args import check_resume, config_from_args, interleaved_configs


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="train a real pipeline on this host (launches torchrun)", description=__doc__)
    p.add_argument("--nproc", type=int, default=None,
                   help="processes to start (default: pipeline ranks x data-parallel replicas of the config/flags)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="torchrun's: restart every rank this many times after one fails; with --checkpoint-dir the "
                        "restarted ranks resume from the last checkpoint (default 0)")
    add_run_arguments(p)
    p.set_defaults(func=run)


def torchrun_args(args: argparse.Namespace, nproc: int) -> list[str]:
    """torchrun's command line (after `torchrun`) for these `mhcpipe run` flags."""
    from pipeline.launch.local import free_port

    cmd = ["--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "--max-restarts", str(getattr(args, "max_restarts", 0)), "-m", "pipeline",
           "--config", str(args.config), "--transport", args.transport]
    if args.comm_rules:
        cmd += ["--comm-rules", args.comm_rules]
    for flag in ("schedule", "microbatches", "pp", "dp", "ep", "steps", "residual", "recompute", "device", "dtype",
                 "timeout", "interleave", "diagnostics_every", "expand", "p2p_groups"):
        value = getattr(args, flag)
        if value is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(value)]
    if args.no_overlap:
        cmd.append("--no-overlap")
    if args.cpu_bind:
        cmd.append("--cpu-bind")
    if args.emulate_cuda:
        cmd.append("--emulate-cuda")
    for flag in ("trace_dir", "trace_format", "checkpoint_dir", "diagnostics_dir", "checkpoint_every",
                 "keep_checkpoints"):
        value = getattr(args, flag)
        if value is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(value)]
    if args.resume is not None:  # as given: every rank decides again from the folder (the same answer)
        cmd.append("--resume" if args.resume else "--no-resume")
    for flag in ("overwrite", "skip_nonfinite", "async_checkpoint"):
        if getattr(args, flag):
            cmd.append(f"--{flag.replace('_', '-')}")
    return cmd


def run(args: argparse.Namespace) -> int:
    if args.nproc is not None and args.nproc < 1:
        raise ValueError(f"--nproc {args.nproc}: must be >= 1")
    cfg = config_from_args(args, args.nproc)  # ValueError -> one line, exit 2 (mhcpipe.cli)
    interleaved_configs(cfg, args)
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts {args.max_restarts}: must be >= 0")
    given = args.resume
    check_resume(cfg, args)  # a refusal is one line here, before torchrun starts (rank 0 says what it decided)
    args.resume = given
    nproc = args.nproc or cfg.parallel.world_size
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run as torchrun

    try:
        torchrun(parse_args(torchrun_args(args, nproc)))
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        code = failure.exitcode
        how = f"exit code {code}" if code > 0 else f"signal {-code}"
        print(f"mhcpipe run: rank {rank} failed first ({how}; its message is above)", file=sys.stderr, flush=True)
        return code if code > 0 else 128 - code  # a signal: the shell's 128 + signal number
    return 0
