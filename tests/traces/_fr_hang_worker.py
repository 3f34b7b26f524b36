"""A 2-rank gloo job that hangs the way a desynchronised run does, then writes Flight Recorder dumps and ledgers.

Run by tests/traces/test_flight_recorder.py under torchrun: both ranks post two collectives through the runtime's
`collective` (the op ledger records them); rank 0 then posts a third that rank 1 never posts and times out with
the runtime's one-line error. Each rank then writes its Flight Recorder buffer (torch's private dump function:
the test's stand-in for NCCL's watchdog, which the product relies on) and its op ledger into the folder argv[1].
"""
import os
import sys
import time

import torch
import torch.distributed as dist

from pipeline.distributed.collective import collective
from pipeline.distributed.errors import PipelineError
from pipeline.observability.fr_setup import write_ledger

folder = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
world = dist.group.WORLD
collective(dist.barrier, what="the start barrier", rank=rank, timeout_s=30, group=world)
x = torch.ones(3)
collective(dist.all_reduce, x, what="the loss all-reduce", rank=rank, timeout_s=30, group=world)
if rank == 0:
    try:
        collective(dist.all_gather, [torch.empty(4), torch.empty(4)], torch.ones(4),
                   what="the step statistics all-gather", rank=rank, timeout_s=2, group=world)
    except PipelineError as err:
        print(f"error: {err}", flush=True)
import torch._C._distributed_c10d as c10d  # noqa: E402 - the test's stand-in for the watchdog's dump

os.makedirs(folder, exist_ok=True)
with open(os.path.join(folder, f"rank_{rank}"), "wb") as f:
    f.write(c10d._dump_fr_trace(includeCollectives=True, includeStackTraces=False, onlyActive=False))
write_ledger(__import__("pathlib").Path(folder), rank)
if rank == 1:
    time.sleep(4)  # stay connected until rank 0 has timed out (a closed peer is another error)
sys.stdout.flush()
os._exit(0)
