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


def _backend_rules_worker(rank, world, cfg_dict, folder):
    import torch

    from configs import parse_config
    from pipeline.runtime.train import RankRuntime, make_groups

    cfg = parse_config(cfg_dict)
    groups = make_groups(cfg, rank, world, torch.device("cpu"))
    rt = RankRuntime(cfg, rank, torch.device("cpu"), groups=groups, record=False)
    strict = rt.strict is not None
    rt.step(0)
    rt.close(program_dir=Path(folder))
    return strict


def test_emulated_cuda_runs_p2p_under_nccls_rules_whatever_the_config_says(tmp_path):
    """gloo's completions are not NCCL's (a send completes before its receive is posted): under --emulate-cuda the
    P2P runs on the strict transport even with train.comm_rules 'backend', and its buffers are still the
    backend's aliases, so the replay sees their releases (rule 8)."""
    from _pipeline_helpers import tiny_config
    from pipeline.runtime.train import comm_rules_of
    from configs import parse_config
    from traces.analysis.cuda_replay import Rules, replay_programs
    from traces.formats.cuda_program import load_programs

    cfg = tiny_config("1f1b", 2, steps=1, comm_rules="backend")
    cfg["train"]["emulate_cuda"] = True
    assert comm_rules_of(parse_config(cfg)) == "nccl"
    assert comm_rules_of(parse_config({**cfg, "train": {**cfg["train"], "emulate_cuda": False}})) == "backend"
    results = launch(_backend_rules_worker, 2, (cfg, str(tmp_path)), timeout_s=120)
    check_ok(results)
    assert [r.value for r in results] == [True, True]
    programs = load_programs(tmp_path)
    messages = ("SEND_F", "SEND_B", "RECV_F", "RECV_B")  # the schedule's, not the warm-up's
    p2p = [p for prog in programs for p in prog.instructions if p["op"] == "nccl" and p["comm"].startswith("p2p")
           and p["ops"][0]["name"].startswith(messages)]
    assert p2p and all(len(p["storages"]) == len(p["ops"]) for p in p2p)
    assert replay_programs(programs, Rules()).ok
