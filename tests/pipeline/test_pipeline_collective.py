"""Collectives and waits that hold on NCCL, checked on CPU: the device each collective's tensors live on against
the group's backend map (NCCL serves cuda tensors only), waits that never use NCCL's busy-waiting
`Work.wait(timeout)`, bounded host waits on the GPU, NCCL's coalesced P2P work, and a whole runtime step under
NCCL's wait semantics on gloo ranks."""
from __future__ import annotations

import re

import time
import types

import pytest
import torch
import torch.distributed as dist

from _pipeline_helpers import check_ok, rel_err, tiny_config
from pipeline.distributed import collective as coll
from pipeline.distributed.comm import Comms, Handle
from pipeline.distributed.errors import PipelineError
from configs import parse_config
from rank_pool import launch
from pipeline.observability.recorder import Recorder


@pytest.fixture
def one_rank_gloo(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_host_tensor_under_ncclS_device_map_is_a_one_line_error(one_rank_gloo, monkeypatch):
    """The step statistics all-reduce of a host tensor on a pure NCCL group failed at step 1 inside NCCL. Under
    NCCL's device map (a gloo group made to serve cuda only, as NCCL does) the helper refuses it before the
    backend sees it, naming the collective and the fix; under gloo's own map the same call reduces."""
    stats = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)  # created without a device: the host
    coll.collective(dist.all_reduce, stats, what="the step statistics all-reduce", rank=0, timeout_s=10,
                    group=one_rank_gloo)
    monkeypatch.setitem(coll.BACKEND_DEVICES, "gloo", tuple(dist.Backend.backend_capability["nccl"]))
    with pytest.raises(PipelineError) as err:
        coll.collective(dist.all_reduce, stats, what="the step statistics all-reduce", rank=0, timeout_s=10,
                        group=one_rank_gloo)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("rank 0: the step statistics all-reduce: a cpu tensor on a gloo process group, which "
                          "serves cuda tensors only"), msg
    assert "group_device" in msg
    with pytest.raises(ValueError, match="serves \\['cuda'\\] tensors, not this run's device cpu"):
        coll.group_device(one_rank_gloo, torch.device("cpu"))


def test_group_device_follows_the_backend_map(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert coll.group_backends(None) == {"cuda": "nccl"}
    assert coll.group_device(None, torch.device("cuda", 3)) == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert coll.group_backends(None) == {"cpu": "gloo", "cuda": "nccl"}
    assert coll.group_device(None, torch.device("cpu")) == torch.device("cpu")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    # a host-staged CUDA run: gloo serves cuda tensors too (torch's capability map), so they stay where they are
    assert coll.group_device(None, torch.device("cuda", 0)) == torch.device("cuda", 0)


class _NcclLikeWork:
    """A work with NCCL's interface: is_completed() queries, wait() orders a stream; a timed wait is the host
    busy-wait this project must never use."""

    def __init__(self, finish_after_s: float | None):
        self.t0 = time.monotonic()
        self.finish_after_s = finish_after_s
        self.queries = 0
        self.waits = 0

    def is_completed(self) -> bool:
        self.queries += 1
        return self.finish_after_s is not None and time.monotonic() - self.t0 >= self.finish_after_s

    def wait(self, timeout=None):
        assert timeout is None, "Work.wait(timeout) on an NCCL work busy-waits the host"
        self.waits += 1
        return True


def _handle(work) -> Handle:
    return Handle(False, "A2A_DISPATCH/s1/mb2/L3.counts", "EP group (ranks 0, 1)", 1, 2, work=work)


def test_stream_ordered_waits_never_pass_a_timeout():
    comms = Comms(0, Recorder(0, torch.device("cpu")), timeout_s=5.0, stream_ordered=True, watch_p2p=False)
    # a consumer on the device: ordered behind the work, the host does not wait for it to finish
    w = _NcclLikeWork(finish_after_s=None)
    h = _handle(w)
    comms.track(h)
    comms.wait(h)
    assert w.waits == 1 and h.done
    # the host reads the result next: polled (sleeping, not spinning), then ordered
    w = _NcclLikeWork(finish_after_s=0.3)
    h = _handle(w)
    comms.track(h)
    comms.wait(h, host=True)
    assert w.waits == 1 and h.done
    assert w.queries < 1000, f"{w.queries} completion queries in 0.3 s: a spinning host"
    # and bounded: a work that never completes ends in a one-line error naming the op and the group
    comms.timeout_s = 0.3
    h = _handle(_NcclLikeWork(finish_after_s=None))
    comms.track(h)
    t0 = time.monotonic()
    with pytest.raises(PipelineError, match=r"^rank 0: timed out after 0.3 s waiting for "
                                            r"A2A_DISPATCH/s1/mb2/L3.counts in the EP group \(ranks 0, 1\)$"):
        comms.wait(h, host=True)
    assert time.monotonic() - t0 < 2.0


def test_polled_wait_of_nccl_works():
    w = _NcclLikeWork(finish_after_s=0.2)
    assert coll.wait_work(w, 5.0, polled=True) and w.waits == 1
    assert not coll.wait_work(_NcclLikeWork(finish_after_s=None), 0.2, polled=True)


class _Event:
    def __init__(self, done: bool):
        self.done = done

    def query(self) -> bool:
        return self.done


def test_gpu_host_waits_are_bounded():
    coll.wait_events([_Event(True), _Event(True)], 1.0, "resolving the step's CUDA events", 3)
    t0 = time.monotonic()
    with pytest.raises(PipelineError, match=r"^rank 3: timed out after 0.2 s in resolving the step's CUDA events"):
        coll.wait_events([_Event(True), _Event(False)], 0.2, "resolving the step's CUDA events", 3)
    assert time.monotonic() - t0 < 1.5


def test_a_coalesced_p2p_work_completes_every_op_of_its_batch(one_rank_gloo, monkeypatch):
    """NCCL returns one work for a whole batch_isend_irecv; every op of the batch must get it (a handle without
    a work would fail at its wait)."""
    from pipeline.distributed.p2p import Transport

    work = _NcclLikeWork(finish_after_s=0.0)
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [work])
    comms = Comms(0, Recorder(0, torch.device("cpu")), timeout_s=5.0, stream_ordered=True, watch_p2p=False)
    tr = Transport(0, torch.device("cpu"), comms)
    x = torch.zeros(4)
    handles = tr.post([(True, "SEND_F/s0/mb0", 0, x), (False, "RECV_B/s0/mb0", 0, torch.empty(4))],
                      labels=[("SEND_F", 0, 0), ("RECV_B", 0, 0)])
    assert [h.work for h in handles] == [work, work]
    for h in handles:
        tr.wait(h)
    assert all(h.done for h in handles)
    names = sorted(s.name for s in comms.recorder.spans if s.stream == "comm")
    assert names == ["RECV_B/s0/mb0~comm", "SEND_F/s0/mb0~comm"]


def test_p2p_errors_name_the_global_rank_not_the_pipeline_rank(one_rank_gloo, monkeypatch):
    """With data parallelism the pipeline rank differs from the global rank (pp=2 x dp=2: global rank 3 is
    pipeline rank 1). A failed post must name the rank the user sees in torchrun's output (CI once printed
    "rank 1: posting SEND_F..." from rank 3), and the peer it lost. (One rank, no groups: the peer's pipeline rank
    is its global rank here.)"""
    from pipeline.distributed.p2p import Transport

    def closed(ops):
        raise RuntimeError("Connection closed by peer [10.0.0.1]:1234")

    monkeypatch.setattr(dist, "batch_isend_irecv", closed)
    comms = Comms(3, Recorder(3, torch.device("cpu")), timeout_s=5.0, watch_p2p=False)
    tr = Transport(1, torch.device("cpu"), comms)
    with pytest.raises(PipelineError) as err:
        tr.post([(True, "SEND_F/s2/mb0", 0, torch.zeros(4))], labels=[("SEND_F", 2, 0)])
    assert str(err.value) == ("rank 3: posting SEND_F/s2/mb0 to rank 0 on world failed: the peer closed its "
                              "connection (it probably died)")


def test_p2p_wait_errors_name_the_peers_global_rank(monkeypatch):
    """The peer of a P2P op is a pipeline rank; with data parallelism its global rank differs (pp=2 x dp=2:
    pipelines (0, 2) and (1, 3), so global rank 2 is pipeline rank 1 of rank 0's pipeline). A receive that fails
    while waited must name the global rank (CI once printed "rank 0: RECV_F/s2/mb0 from rank 1" for rank 2)."""
    from pipeline.distributed.p2p import Transport

    class DeadPeerWork:
        def is_completed(self):
            return True  # ended, with the error

        def wait(self, timeout=None):
            raise RuntimeError("Connection closed by peer [10.0.0.3]:1234")

    from pipeline.distributed.layout import Layout

    channel = object()  # stands for the channel group p2p:2>0
    monkeypatch.setattr(dist, "P2POp", lambda *a, **k: None)
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [DeadPeerWork() for _ in ops])

    class Groups:  # the rank's layout.ParallelGroups, as far as the transport reads it
        layout = Layout(2, 2, 1, "1f1b")
        dp_rank = 0

        def channel(self, src, dst):
            return channel

        def name_of(self, group):
            return "p2p:2>0"

    comms = Comms(0, Recorder(0, torch.device("cpu")), timeout_s=5.0, watch_p2p=False)
    tr = Transport(0, torch.device("cpu"), comms, groups=Groups())
    (h,) = tr.post([(False, "RECV_F/s2/mb0", 1, torch.zeros(4))], labels=[("RECV_F", 2, 0)])
    with pytest.raises(PipelineError) as err:
        tr.wait(h)
    assert str(err.value).startswith("rank 0: RECV_F/s2/mb0 from rank 2 failed after "), str(err.value)
    assert str(err.value).endswith("the peer closed its connection (it probably died)"), str(err.value)


# ---------------------------------------------------------------------------------------- a runtime under NCCL's
class _HostMarkingTorch(types.ModuleType):
    """`torch` as the runtime modules see it in the NCCL mimic: a tensor created from nothing without a device
    (torch.tensor/zeros/empty/ones/full/arange with device=None) is marked as a host tensor. On a CPU machine host
    and device are the same, so the mark stands for what NCCL would receive as a cpu tensor."""

    _MAKERS = ("tensor", "zeros", "empty", "ones", "full", "arange")

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        real = getattr(torch, name)
        if name not in self._MAKERS:
            return real

        def make(*args, device=None, **kwargs):
            t = real(*args, device=device, **kwargs)
            if device is None:
                t._made_on_host = True
            return t

        return make


def _nccl_semantics_worker(rank, world, cfg_dict, mimic):
    """One step of the runtime. With `mimic` (NCCL on gloo ranks): every group reports NCCL, whose device map
    refuses host tensors (a tensor the runtime made without placing it: `_HostMarkingTorch`), every collective's
    tensors are checked against it (blocking ones through `collective`, async ones through `Comms.post`), and the
    rank's Comms is stream-ordered, so every wait takes NCCL's path (polled completion, untimed ordering wait).
    The patches are undone when the step returns: the rank process serves later cases (tests/rank_pool.py)."""
    from contextlib import ExitStack
    from unittest import mock

    import pipeline.distributed.collective
    import pipeline.distributed.comm
    import pipeline.runtime.executor
    import pipeline.distributed.expert
    import pipeline.distributed.grad_reduce
    import pipeline.runtime.train
    from pipeline.runtime.train import RankRuntime, make_groups

    cfg = parse_config(cfg_dict)
    device = torch.device("cpu")
    groups = make_groups(cfg, rank, world, device)
    seen = []
    with ExitStack() as patches:
        if mimic:
            real_check = pipeline.distributed.collective.check_devices

            def check(args, group, what, r):
                seen.append(what)
                for t in pipeline.distributed.collective.tensor_args(args):
                    if getattr(t, "_made_on_host", False):
                        raise PipelineError(f"rank {r}: {what}: a host tensor on an NCCL process group")
                return real_check(args, group, what, r)

            real = pipeline.runtime.train.Comms
            for target, name, value in [
                    (pipeline.distributed.collective, "group_backends", lambda group=None: {"cpu": "nccl"}),
                    (pipeline.distributed.collective, "check_devices", check),
                    (pipeline.distributed.comm, "check_devices", check),
                    (pipeline.runtime.train, "Comms", lambda *a, **kw: real(*a, **{**kw, "stream_ordered": True}))] + [
                    (mod, "torch", _HostMarkingTorch())
                    for mod in (pipeline.runtime.train, pipeline.runtime.executor, pipeline.distributed.grad_reduce,
                                pipeline.distributed.expert)]:
                patches.enter_context(mock.patch.object(target, name, value))
        rt = RankRuntime(cfg, rank, device, groups=groups, record=True)
        rt.align_clocks()
        st = rt.step(0)
        assert rt.comms.stream_ordered == mimic
        rt.close()
    return {"loss": st.loss, "grads": rt.grads(), "helper_calls": seen,
            "waits": sum(1 for s in rt.recorder.spans if s.kind == "WAIT")}


def _nccl_path_matches_plain(cfg) -> list:
    """One step on 4 ranks, plain gloo and on NCCL's code path: loss and every gradient equal (fp64, 1e-12);
    returns the NCCL-path results."""
    plain = launch(_nccl_semantics_worker, 4, (cfg, False), timeout_s=200)
    check_ok(plain)
    nccl = launch(_nccl_semantics_worker, 4, (cfg, True), timeout_s=200)
    check_ok(nccl)
    for a, b in zip(plain, nccl):
        assert abs(a.value["loss"] - b.value["loss"]) <= 1e-12 * abs(a.value["loss"])
        assert a.value["grads"] and set(a.value["grads"]) == set(b.value["grads"]), "gradients of other parameters"
        for name, g in a.value["grads"].items():
            assert rel_err(b.value["grads"][name], g) <= 1e-12, name
    return nccl


@pytest.mark.timeout(240)
def test_runtime_step_under_nccl_wait_semantics_matches():
    """pp=2 dp=2 ep=2 on tiny MoE (float64): P2P, the expert all-to-alls (with their host read of the counts),
    the gradient reductions and every blocking collective take the NCCL code path of the waits, and no tensor the
    runtime hands a collective was made on the host (the step statistics all-reduce of a host tensor failed every
    NCCL run at step 1); loss and gradients equal the gloo path's."""
    cfg = tiny_config("dualpipev", 2, n=4, moe=True, dp=2, ep=2, dtype="float64", steps=1, timeout_s=60)
    for b in _nccl_path_matches_plain(cfg):
        calls = set(b.value["helper_calls"])
        assert any(c.startswith("A2A_DISPATCH/") for c in calls) and any(c.startswith("RG/") for c in calls), calls
        assert {"the start barrier", "the clock exchange",
                "the step statistics all-gather"} <= calls, calls


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", ["gpipe", "dualpipev"])
def test_blocking_waits_on_nccls_path_with_three_moe_blocks_per_stage(schedule):
    """Blocking waits under NCCL's rules: on the NCCL code path every wait the runtime issues is untimed
    (`Work.wait()`), and under the strict transport such a wait blocks the host until its batch ran, as
    TORCH_NCCL_BLOCKING_WAIT=1 makes NCCL's do. With 3 MoE blocks in a stage (expert count reads in every one) and
    GPipe's early-posted receives, a wait issued before its result is needed would hang here; the step must
    finish with the plain gloo path's loss and gradients (fp64, 1e-12)."""
    blocks = 8 if schedule == "gpipe" else 16  # 2 stages of 4 blocks (gpipe), 4 of 4 (dualpipev): >= 3 MoE each
    cfg = tiny_config(schedule, 2, n=4, moe=True, dp=2, ep=2, dtype="float64", steps=1, timeout_s=60, blocks=blocks)
    for b in _nccl_path_matches_plain(cfg):
        # this rank read expert counts in at least 3 MoE layers of one stage (layers L<2b+1> of its blocks)
        layers = {int(m) for c in b.value["helper_calls"] for m in re.findall(r"L(\d+)\.counts", c)}
        assert len(layers) >= 3, sorted(layers)
