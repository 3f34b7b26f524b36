"""torchrun entry: `torchrun --nproc-per-node 4 -m pipeline --config configs/tiny.yaml --schedule dualpipev
--trace-dir runs/x`. With `--interleave residual:1` the same job also trains the baseline, one step of each in
turn (pipeline.runtime.train.train_interleaved), and writes runs/x/mhc_4/ and runs/x/residual_1/.

Layout: world = pipeline ranks (--pp) x data-parallel replicas (--dp), expert parallelism (--ep) inside dp
(pipeline.distributed.layout); without --pp the pipeline takes world / dp ranks. Several nodes: the same command on
each,
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

from pipeline.launch.run_args import (add_run_arguments, check_resume, config_from_args, diagnostics_dir,
                                      interleaved_configs, variant_dir)


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

    from pipeline.distributed.errors import PipelineError
    from pipeline.distributed.p2p import init_distributed
    from pipeline.runtime.train import pick_device, train, train_interleaved

    try:
        device = pick_device(cfg, local_rank)
        staged = args.transport == "host"
        if device.type == "cuda":
            if local_world > torch.cuda.device_count():
                staged = True  # NCCL refuses two ranks on one GPU
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" and not staged else "gloo"
        init_distributed(backend, cfg.train.timeout_s, device)
        log = lambda line: print(line, flush=True)  # noqa: E731
        if len(cfgs) > 1:
            dirs = None if args.trace_dir is None else [variant_dir(args.trace_dir, c) for c in cfgs]
            diag = diagnostics_dir(args)
            train_interleaved(cfgs, rank, world, device, trace_dirs=dirs, staged=staged, log=log,
                              diagnostics_dirs=None if diag is None else [variant_dir(diag, c) for c in cfgs])
        else:
            train(cfg, rank, world, device, trace_dir=args.trace_dir, diagnostics_dir=diagnostics_dir(args),
                  checkpoint_dir=args.checkpoint_dir,
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
    # Skip interpreter finalization: on a loaded host it can abort a rank ("terminate called without an active
    # exception") after destroy_process_group has returned and the run has written everything; torchrun would
    # then report the whole run failed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
