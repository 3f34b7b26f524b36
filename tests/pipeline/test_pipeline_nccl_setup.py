"""What a CUDA launch decides before its process group exists, checked on CPU: the NCCL watchdog's timeout, a
blocking-wait setting, and whether the ranks of a node share a GPU (pipeline.distributed.p2p,
pipeline.launch.gpu_sharing)."""
from __future__ import annotations

import threading

import torch.distributed as dist

from pipeline.distributed.p2p import override_blocking_wait, process_group_timeout_s
from pipeline.launch.gpu_sharing import shares_a_gpu


def test_nccl_watchdog_comes_well_after_the_step_deadline():
    """The step deadline's one-line error must come first: step 1 (JIT, first connections, fill) may take many
    steady steps, so NCCL's process-group timeout is 10x the deadline and never under 15 minutes; gloo keeps it."""
    assert process_group_timeout_s("nccl", 60.0) == 900.0
    assert process_group_timeout_s("nccl", 300.0) == 3000.0
    assert process_group_timeout_s("gloo", 60.0) == 60.0


def test_blocking_wait_is_overridden_with_one_line():
    env = {"TORCH_NCCL_BLOCKING_WAIT": "1", "PATH": "/bin"}
    line = override_blocking_wait(env)
    assert env["TORCH_NCCL_BLOCKING_WAIT"] == "0" and env["PATH"] == "/bin"
    assert line is not None and "\n" not in line and "TORCH_NCCL_BLOCKING_WAIT=1 overridden to 0" in line
    legacy = {"NCCL_BLOCKING_WAIT": "true"}
    assert "NCCL_BLOCKING_WAIT=true" in override_blocking_wait(legacy) and legacy["NCCL_BLOCKING_WAIT"] == "0"
    for unset in ({}, {"TORCH_NCCL_BLOCKING_WAIT": "0"}):
        assert override_blocking_wait(dict(unset)) is None


def _ranks_report(uuids: list[str]) -> list[bool]:
    """Each local rank (a thread) publishes its GPU's UUID in one store and says whether another has the same."""
    store = dist.HashStore()
    out: list = [None] * len(uuids)

    def rank(r: int) -> None:
        out[r] = shares_a_gpu(store, "0/0", r, len(uuids), uuids[r], timeout_s=10)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(uuids))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_one_visible_gpu_per_rank_is_not_a_shared_gpu():
    """SLURM --gpus-per-task=1: device_count() is 1 on every rank, but each sees its own GPU, so NCCL it is (the
    old rule, local ranks > visible GPUs, chose the host-staged transport here)."""
    assert _ranks_report(["GPU-a", "GPU-b", "GPU-c", "GPU-d"]) == [False] * 4


def test_ranks_on_one_gpu_are_found_sharing_it():
    assert _ranks_report(["GPU-a"] * 4) == [True] * 4
    assert _ranks_report(["GPU-a", "GPU-b", "GPU-a", "GPU-c"]) == [True, False, True, False]


def test_the_watchdog_also_comes_after_the_first_steps_deadline():
    """Step 1 on a GPU has its own, longer deadline (train.first_step_timeout_s: JIT and connections); NCCL's
    watchdog must come after it too, or it aborts the job without the deadline's one-line error."""
    assert process_group_timeout_s("nccl", 60.0, 600.0) == 900.0
    assert process_group_timeout_s("nccl", 60.0, 1800.0) > 1800.0
    assert process_group_timeout_s("gloo", 60.0, 1800.0) == 60.0


def test_every_subgroup_gets_the_worlds_timeout(monkeypatch):
    """new_group / split_group without a timeout get torch's default (10 minutes on NCCL), not the world's: every
    group build_groups makes (P2P channels, expert groups, gradient groups) is made with the one it is given."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from pipeline.distributed import layout as lay

    made = []

    def new_group(ranks=None, **kw):
        made.append(kw.get("timeout"))
        return object()

    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 8)
    monkeypatch.setattr(lay, "use_split", lambda env=None: False)
    monkeypatch.setattr(lay, "_members", lambda g: "0,1")
    monkeypatch.setattr(DeviceMesh, "from_group", staticmethod(lambda *a, **k: None))
    lay.build_groups(lay.Layout(pp=2, dp=4, ep=2, schedule="dualpipev"), 0, "cpu", timeout_s=1234.0)
    assert len(made) >= 6 and all(t == datetime.timedelta(seconds=1234.0) for t in made), made


def test_the_backend_is_said_and_never_falls_back_unasked(monkeypatch):
    import pytest
    import torch

    from pipeline.launch import gpu_sharing

    assert gpu_sharing.choose_backend(torch.device("cpu"), 0, 4, "auto", emulate=True)[0:2] == ("gloo", False)
    cuda = torch.device("cuda", 0)
    assert gpu_sharing.choose_backend(cuda, 0, 4, "host", emulate=False)[:2] == ("gloo", True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(gpu_sharing, "gpu_shared_with_another_rank", lambda *a: None)
    with pytest.raises(ValueError, match="cannot be checked.*--transport host"):
        gpu_sharing.choose_backend(cuda, 0, 4, "auto", emulate=False)
    monkeypatch.setattr(gpu_sharing, "gpu_shared_with_another_rank", lambda *a: True)
    with pytest.raises(ValueError, match="shares its GPU.*--transport host"):
        gpu_sharing.choose_backend(cuda, 0, 4, "auto", emulate=False)
    monkeypatch.setattr(gpu_sharing, "gpu_shared_with_another_rank", lambda *a: False)
    backend, staged, why = gpu_sharing.choose_backend(cuda, 0, 4, "auto", emulate=False)
    assert (backend, staged) == ("nccl", False) and "one GPU per rank" in why


def test_the_first_step_on_a_gpu_has_its_own_deadline():
    import torch

    from configs import load_config
    from pipeline.runtime.train import first_step_deadline

    cfg = load_config("tiny")
    assert cfg.train.timeout_s == 60.0 and cfg.train.first_step_timeout_s == 600.0
    assert first_step_deadline(cfg, torch.device("cuda", 0)) == 600.0
    assert first_step_deadline(cfg, torch.device("cpu")) == 60.0  # no JIT, and the deadlock tests stay short


def test_dumps_and_ledgers_of_other_nodes_reach_rank_0_through_the_store():
    """After a hang the NCCL group cannot carry anything; torchrun's store can: every rank publishes its dump and
    ledger, rank 0 gets all of them (a rank that never publishes is waited for only up to the limit)."""
    import time

    from pipeline.observability.fr_setup import share_files

    store = dist.HashStore()
    world = 3
    got: dict = {}

    def rank(r: int) -> None:
        files = {f"actions_rank{r}.json": f"ledger {r}".encode(), f"rank_{r}": bytes([r, 0, 255])}
        out = share_files(store, "fr/run/0", r, world, files, limit_s=10)
        if r == 0:
            got.update(out)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 2, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert set(got) == {f"actions_rank{r}.json" for r in range(3)} | {f"rank_{r}" for r in range(3)}
    assert got["rank_2"] == bytes([2, 0, 255]) and got["actions_rank1.json"] == b"ledger 1"
    # a rank that died before publishing: rank 0 stops waiting at the limit and keeps what arrived
    store2 = dist.HashStore()
    share_files(store2, "k", 1, 3, {"actions_rank1.json": b"x"}, limit_s=1)
    t0 = time.monotonic()
    out = share_files(store2, "k", 0, 3, {"actions_rank0.json": b"y"}, limit_s=0.5)
    assert set(out) == {"actions_rank0.json", "actions_rank1.json"} and time.monotonic() - t0 < 5
