"""The torchrun entry's body: `torchrun --nproc-per-node 4 -m pipeline --config configs/tiny.yaml --schedule
dualpipev --trace-dir runs/x` (pipeline/__main__.py calls `main`), and a user's own script, whose last line is
`raise SystemExit(main(build))` (`torchrun --nproc-per-node 4 my_model.py --schedule dualpipev`: its model, built by
`build`, through the same runtime; pipeline.user_model, pipeline.launch.user_config). With `--interleave
residual:1` the same job also trains the baseline, one step of each in turn
(pipeline.runtime.train.train_interleaved), and writes runs/x/mhc_4/ and runs/x/residual_1/.

Layout: world = pipeline ranks (--pp) x data-parallel replicas (--dp), expert parallelism (--ep) inside dp
(pipeline.distributed.layout); without --pp the pipeline takes world / dp ranks. Several nodes: the same command on
each, with torchrun's --nnodes and rendezvous flags. Reads RANK / WORLD_SIZE / LOCAL_RANK (and LOCAL_WORLD_SIZE) from
torchrun. Backend: NCCL when every rank has its own GPU, gloo on CPU, and gloo with the host-staged transport
when several ranks share a GPU (or with --transport host). Bad flags, config, layout or user model: one line on
stderr, exit 2, before any rank computes. A distributed failure (timeout, dead peer): one line naming the rank, the
op and the peer, exit 1, without tearing the group down (that can hang with a dead peer).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pipeline.launch.run_args import (COMM_RULES, COMM_RULES_ENV, check_resume, config_from_args, diagnostics_dir,
                                      interleaved_configs, variant_dir)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The run's flags (this entry's and `mhcpipe run`'s; pipeline.launch.run_args turns them into the config)."""
    p.add_argument("--config", default="tiny", help="YAML path or preset name in configs/ (default tiny)")
    from schedules.registry import names

    p.add_argument("--schedule", choices=names(), help="parallel.schedule (schedules.registry)")
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
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float64"],
                   help="train.dtype: activations (bfloat16: fp32 parameters; a user model runs under autocast)")
    p.add_argument("--timeout", type=float, help="train.timeout_s (every P2P wait and collective)")
    p.add_argument("--emulate-cuda", action="store_true",
                   help="train.emulate_cuda: run the CUDA path (streams, events, stream-ordered waits, host reads) "
                        "on CPU tensors under the emulated CUDA device; with --trace-dir D each rank's program goes "
                        "to D for `mhcpipe check-comm --cuda D` (docs/cuda_program.md)")
    p.add_argument("--transport", choices=["auto", "host"], default="auto",
                   help="'auto' (default) or 'host' = stage P2P through host memory (several ranks on one GPU)")
    p.add_argument("--comm-rules", choices=COMM_RULES, default=os.environ.get(COMM_RULES_ENV) or None,
                   help="train.comm_rules (default the config's, or $MHCPIPE_COMM_RULES, which the test suite sets "
                        "to nccl): 'nccl' = gloo P2P under NCCL's rules (a posting order that would hang on NCCL "
                        "fails here with every rank's queue heads), 'nccl-pair' = the same with one queue per rank "
                        "pair, 'backend' = the backend's own semantics"),
    p.add_argument("--p2p-groups", choices=["channel", "shared"],
                   help="parallel.p2p_groups: 'channel' (default) = one process group per direction of each "
                        "pipeline link; 'shared' = one for all, the old design that deadlocks under NCCL (kept to "
                        "reproduce it with --comm-rules nccl and mhcpipe check-comm)")
    p.add_argument("--diagnostics-every", type=int, metavar="K",
                   help="train.diagnostics_every: log stream-collapse diagnostics on step 0, every K-th step and the "
                        "last, into --diagnostics-dir or --trace-dir (draw them with `mhcpipe diagnose`)")
    p.add_argument("--diagnostics-dir", type=Path,
                   help="where diagnostics_rank<r>.json go (default --trace-dir); without --trace-dir no spans are "
                        "recorded, so a run of hundreds of steps stays light")
    p.add_argument("--trace-dir", type=Path, help="write per-rank spans and the merged trace.json here")
    p.add_argument("--trace-format", choices=["json", "npz"],
                   help="train.trace_format: our JSON (default) or our binary columns (.npz: rank<r>.npz and "
                        "trace.npz, docs/traces.md §8), for the traces of long runs")
    p.add_argument("--checkpoint-dir", type=Path,
                   help="write a checkpoint here after every step (DCP, by parameter name: any layout resumes it; "
                        "pipeline/checkpoint/dcp.py)")
    p.add_argument("--resume", action="store_const", const=True, default=None,
                   help="continue from the checkpoint in --checkpoint-dir, or fail (default: resume when the folder "
                        "holds a checkpoint of this model; pipeline/checkpoint/policy.py)")
    p.add_argument("--no-resume", dest="resume", action="store_const", const=False,
                   help="start fresh; refused on a folder holding checkpoints unless --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="a fresh run (--no-resume, or another model config) may replace the folder's checkpoints")
    p.add_argument("--checkpoint-every", type=int, metavar="K",
                   help="train.checkpoint_every: save after every K-th step and after the last (default 1)")
    p.add_argument("--keep-checkpoints", type=int, metavar="N",
                   help="train.keep_checkpoints: the newest N complete checkpoints are kept (default 2)")
    p.add_argument("--async-checkpoint", action="store_true",
                   help="train.checkpoint_async: stage each checkpoint to host memory and write it in the background "
                        "(pipeline/checkpoint/async_save.py)")
    p.add_argument("--skip-nonfinite", action="store_true",
                   help="train.skip_nonfinite: skip a step whose loss or gradient norm is not finite (no update, "
                        "counted) instead of stopping the run")
    p.add_argument("--interleave", metavar="VARIANT:N",
                   help="also train this residual (e.g. residual:1), one step of each in turn (A B B A ...): an "
                        "A/B measurement of the residual's cost in which both see the same machine state; "
                        "traces go to TRACE_DIR/<variant>_<n>/")


def main(argv: list[str] | None = None, build=None) -> int:
    """Parse the run flags and train. `build`: a user's model builder (pipeline.launch.user_config), None = the
    built-in model of --config."""
    prog = "python -m pipeline" if build is None else Path(sys.argv[0]).name
    parser = argparse.ArgumentParser(prog=prog, description="Train a model on a DualPipe-style pipeline (torchrun).")
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        how = "-m pipeline" if build is None else sys.argv[0]
        print(f"{prog}: error: not started by torchrun (RANK/WORLD_SIZE unset); "
              f"use `torchrun --nproc-per-node P {how} ...`" + (" or `mhcpipe run ...`" if build is None else ""),
              file=sys.stderr)
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    model = None
    try:
        if build is None:
            cfg = config_from_args(args, world)
            cfgs = interleaved_configs(cfg, args)
        else:
            from pipeline.launch.user_config import user_run

            cfg, model = user_run(build, args, world)
            cfgs = [cfg]
        said = check_resume(cfg, args)
        if said and rank == 0:
            print(f"{prog}: {said}", file=sys.stderr, flush=True)
    except ValueError as err:
        # every rank reports: torchrun may kill rank 0 before it prints once another rank has exited
        print(f"{prog}: error (rank {rank}): {err}", file=sys.stderr, flush=True)
        return 2

    import torch

    from pipeline.distributed.errors import PipelineError
    from pipeline.distributed.p2p import init_distributed
    from pipeline.observability.fr_setup import flight_recorder_dir, flight_recorder_env
    from pipeline.launch.gpu_sharing import choose_backend
    from pipeline.runtime.train import pick_device, train, train_interleaved

    fr_dir, backend = None, "gloo"
    try:
        device = pick_device(cfg, local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # NCCL refuses two ranks on one GPU; one visible GPU per rank (SLURM --gpus-per-task=1) is not that
        backend, staged, why = choose_backend(device, local_rank, local_world, args.transport,
                                              cfg.train.emulate_cuda, cfg.train.timeout_s)
        if rank == 0:
            print(f"{prog}: backend {backend}{' (host-staged P2P)' if staged else ''}: {why}", file=sys.stderr,
                  flush=True)
        fr_dir = flight_recorder_dir(args.trace_dir, os.environ)
        flight_recorder_env(fr_dir, os.environ)  # before the process group exists: torch reads it at creation
        note = init_distributed(backend, cfg.train.timeout_s, device, cfg.train.first_step_timeout_s)
        if note and rank == 0:
            print(f"{prog}: note: {note}", file=sys.stderr, flush=True)
        def log(line: str) -> None:
            print(line, flush=True)

        if len(cfgs) > 1:
            dirs = None if args.trace_dir is None else [variant_dir(args.trace_dir, c) for c in cfgs]
            diag = diagnostics_dir(args)
            train_interleaved(cfgs, rank, world, device, trace_dirs=dirs, staged=staged, log=log,
                              diagnostics_dirs=None if diag is None else [variant_dir(diag, c) for c in cfgs])
        else:
            train(cfg, rank, world, device, trace_dir=args.trace_dir, diagnostics_dir=diagnostics_dir(args),
                  checkpoint_dir=args.checkpoint_dir,
                  resume=args.resume, staged=staged, log=log, model=model)
    except PipelineError as err:
        print(f"mhcpipe: error: {err}", file=sys.stderr, flush=True)
        if fr_dir is not None and not err.hang_related:  # a NaN is not a communication fault
            report_flight_recorder(fr_dir, rank, backend, cfg.train.timeout_s, cfg.train.first_step_timeout_s)
        os._exit(1)
    except ValueError as err:
        print(f"{prog}: error (rank {rank}): {err}", file=sys.stderr, flush=True)
        os._exit(2)
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


def report_flight_recorder(folder, rank: int, backend: str, timeout_s: float,
                           first_step_timeout_s: float = 0.0) -> None:
    """After a one-line error: this rank's op ledger next to Flight Recorder's dumps, and one line saying where they
    are. NCCL: the watchdog writes the dumps when the stuck op reaches the process-group timeout (counted from its
    post); the rank waits that long for its own (MHCPIPE_FR_WAIT_S overrides; 0 = do not wait), so that torchrun
    does not stop the job before every rank has written."""
    from pipeline.distributed.p2p import process_group_timeout_s
    from pipeline.observability.fr_setup import dump_prefix, wait_for_dump, write_ledger

    try:
        write_ledger(folder, rank)
    except OSError as err:
        print(f"mhcpipe: note: could not write the op ledger into {folder}: {err}", file=sys.stderr, flush=True)
        return
    prefix = dump_prefix(os.environ) or str(folder / "rank_")
    if backend != "nccl":
        if rank == 0:
            print(f"mhcpipe: note: op ledgers in {folder} (Flight Recorder writes dumps on NCCL runs only, at the "
                  "process-group timeout)", file=sys.stderr, flush=True)
        return
    wait = float(os.environ.get("MHCPIPE_FR_WAIT_S",
                                process_group_timeout_s(backend, timeout_s, first_step_timeout_s) + 30))
    if rank == 0:
        print(f"mhcpipe: note: Flight Recorder dumps go to {prefix}<rank> when NCCL's watchdog reaches the stuck op "
              f"(waiting up to {wait:.0f} s; MHCPIPE_FR_WAIT_S=0 skips); then: mhcpipe check-comm {folder}",
              file=sys.stderr, flush=True)
    got = wait_for_dump(prefix, rank, wait) if wait > 0 else False
    print(f"mhcpipe: rank {rank}: Flight Recorder dump {'written: ' + prefix + str(rank) if got else 'not written'}"
          f"; op ledger {folder}/actions_rank{rank}.json", file=sys.stderr, flush=True)
    gather_to_rank0(folder, prefix, rank, wait)


def gather_to_rank0(folder: Path, prefix: str, rank: int, wait_s: float) -> None:
    """Ranks on other nodes keep their dumps and ledgers on their own disks: each publishes them through torchrun's
    store and rank 0 writes every rank's into its folder (pipeline.observability.fr_setup.share_files). Only
    under torchrun's agent store (a store that exists apart from the hung process group)."""
    import datetime

    import torch.distributed as dist

    from pipeline.observability.fr_setup import STORE_PREFIX, share_files

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mine = {p.name: p.read_bytes() for p in (Path(folder) / f"actions_rank{rank}.json", Path(prefix + str(rank)))
            if p.is_file()}
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=30))
        key = f"{STORE_PREFIX}/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/" \
              f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        got = share_files(store, key, rank, world, mine, limit_s=min(wait_s, 60.0) + 30.0)
    except Exception as err:  # noqa: BLE001 - the store is gone with the job: say so, do not fail the report
        print(f"mhcpipe: note: rank {rank}: could not share its dump and ledger through torchrun's store: {err}",
              file=sys.stderr, flush=True)
        return
    dump_dir = Path(prefix).parent
    for name, data in got.items():
        target = (Path(folder) if name.startswith("actions_rank") else dump_dir) / name
        if not target.exists():
            target.write_bytes(data)
    if rank == 0 and got:
        print(f"mhcpipe: rank 0 gathered {len(got)} dump and ledger file(s) of {world} ranks into {folder}",
              file=sys.stderr, flush=True)


