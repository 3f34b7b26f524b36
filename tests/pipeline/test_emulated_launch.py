"""The emulated CUDA device completes one NCCL launch as one (pipeline/device/emulated.py, docs/cuda_program.md).

NCCL runs a grouped P2P batch as one kernel: ProcessGroupNCCL returns one coalesced work, and whatever a stream
orders behind it runs only when every op of the batch ran. Gloo returns a work per op and completes a receive as
soon as its own message arrived. The emulated device must follow NCCL: with per-op completion, a stream the
runtime reused behind one receive of a batch looked idle while the batch's other receive was still unsent, the
program recorded a host wait a GPU never makes, and `check-comm --cuda` reported a cycle (the README's emulated
run, 1 run in about 6 under load).
"""
from __future__ import annotations

import time
from pathlib import Path

from _pipeline_helpers import check_ok
from rank_pool import launch


def _batch_worker(rank, world, flag_dir):
    import torch
    import torch.distributed as dist

    from pipeline.device.emulated import EmulatedCuda

    flag = Path(flag_dir) / "first-seen"
    if rank == 1:  # the sender: the second message only once rank 0 has seen the first arrive
        for i, value in enumerate((1.0, 2.0)):
            if i == 1:
                deadline = time.monotonic() + 60
                while not flag.exists():
                    assert time.monotonic() < deadline, "rank 0 never saw the first message"
                    time.sleep(0.01)
            dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((4,), value), 0)])[0].wait()
        return None
    dev = EmulatedCuda(rank, world, timeout_s=60)
    bufs = [torch.zeros(4), torch.zeros(4)]
    works = dev.post(lambda: dist.batch_isend_irecv([dist.P2POp(dist.irecv, b, 1) for b in bufs]), comm="p2p:1>0",
                     members=[0, 1], ops=[("recv", 1, "RECV/a"), ("recv", 1, "RECV/b")], tensors=[])
    deadline = time.monotonic() + 60  # the first message has landed (gloo receives into the tensor; only the
    while bufs[0][0].item() != 1.0:  # device's watcher may wait() on the works: gloo wakes one waiter per receive)
        assert time.monotonic() < deadline, "the first message never arrived"
        time.sleep(0.01)
    end = dev.new_stream("end")  # a stream ordered behind the first receive only, as the runtime's end streams are
    dev.wait_work(works[0], end)
    ev = dev.event()
    ev.record(end)
    before = (dev.work_done(works[0]), ev.query())
    flag.touch()
    ok = dev.host_wait_work(works[0], 60)
    after = (dev.work_done(works[0]), ev.query(), dev.host_wait_events([ev], 60))
    dev.close()
    launches = [p for p in dev.program if p["op"] == "nccl"]
    return before, ok, after, [bufs[0][0].item(), bufs[1][0].item()], len(launches), len(launches[0]["ops"])


def test_one_receive_of_a_batch_does_not_complete_the_launch(tmp_path):
    results = launch(_batch_worker, 2, (str(tmp_path),), timeout_s=90)
    check_ok(results)
    before, ok, after, values, launches, ops = results[0].value
    assert before == (False, False)  # the batch's second receive is unsent: neither the work nor the event is done
    assert ok and after == (True, True, True)
    assert values == [1.0, 2.0]
    assert (launches, ops) == (1, 2)
