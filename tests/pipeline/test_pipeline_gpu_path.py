"""The CUDA path's ordering logic, checked where a CPU can see it (the GPU itself: bench/gpu_check.sh).

* single-pass mHC packs (x, a) only after the hp stream's post+res that wrote x was waited for;
* a sent stage output is freed once its send is done: the backward keeps only its gradient edge;
* with fixed turns (CUDA) an F&B pair can start with its backward half (the one whose input is here);
* an F&B pair's spans are process-wide NVTX ranges (they may end on another thread than they began);
* with EP the count exchange's host read is queued behind the exchange, not behind the compute stream.
"""
from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from _pipeline_helpers import tiny_config


def _runtime(schedule="1f1b", n=4, variant=None, rank=0, ranks=2):
    from configs import parse_config
    from pipeline.runtime.train import RankRuntime

    cfg = tiny_config(schedule, ranks, n=n, steps=1)
    if variant is not None:
        cfg["model"]["residual"]["variant"] = variant
    cfg = parse_config(cfg)
    return cfg, RankRuntime(cfg, rank, torch.device("cpu"), record=False)


def test_single_pass_packs_after_the_hp_stream_is_waited_for(monkeypatch):
    """mhc-sp: the stage output is torch.cat(x, a); x comes from the MLP's post+res, which on CUDA runs on the hp
    stream. The pack must come after `sync_hp` (else it reads x while the hp stream may still write it)."""
    from kernels import single_pass
    from pipeline.runtime.stage import ChunkRun

    cfg, rt = _runtime(variant="mhc-sp")
    env = rt.env
    pending = {"post": 0}
    real_post, real_sync, real_pack = env.hp_post, env.sync_hp, single_pass.pack_state

    def hp_post(*a, **k):
        pending["post"] += 1
        return real_post(*a, **k)

    def sync_hp():
        pending["post"] = 0
        real_sync()

    def pack(x, a):
        assert pending["post"] == 0, "packed a post+res output the hp stream may still be writing"
        return real_pack(x, a)

    monkeypatch.setattr(env, "hp_post", hp_post)
    monkeypatch.setattr(env, "sync_hp", sync_hp)
    monkeypatch.setattr(single_pass, "pack_state", pack)
    (stage,) = rt.stages.values()
    t = cfg.parallel.tokens_per_microbatch
    ids = torch.randint(0, cfg.model.vocab_size, (t,))
    run = ChunkRun(stage.spec.stage, 0)
    for _ in stage.forward_steps(run, ids, None, env):
        pass
    assert run.output is not None


def test_a_sent_output_is_freed_once_its_send_is_done(monkeypatch):
    """DualPipe frees a stage's output after its send: the backward needs its gradient, not its values. Here the
    output tensor must be gone (weakref dead) by the time its chunk's backward starts, and the backward must
    still produce the same gradients (the equivalence tests compare them with the single-process model)."""
    from pipeline.data import make_batch
    from pipeline.distributed.loopback import LoopbackTransport
    from pipeline.runtime.stage import ChunkRun, Stage

    cfg, rt = _runtime(rank=0)
    shape = (cfg.parallel.tokens_per_microbatch, cfg.model.residual.n, cfg.model.hidden)
    rt.use_transport(LoopbackTransport(0, torch.device("cpu"), shape, rt.dtype))
    sent: dict[tuple[int, int], weakref.ref] = {}
    real_release, real_backward = ChunkRun.release_output, Stage.backward_steps

    def release(self):
        out = real_release(self)
        sent[(self.stage, self.mb)] = weakref.ref(out)
        assert self.output is None and not torch.is_tensor(self.segs[-1][1]), "the backward still holds the output"
        return out

    alive_at_backward = []

    def backward_steps(self, run, grad, env):
        gc.collect()
        ref = sent.get((run.stage, run.mb))
        if ref is not None and ref() is not None:
            alive_at_backward.append((run.stage, run.mb))
        yield from real_backward(self, run, grad, env)

    monkeypatch.setattr(ChunkRun, "release_output", release)
    monkeypatch.setattr(Stage, "backward_steps", backward_steps)
    rt.executor.run_step(make_batch(cfg, 0))
    assert sent, "rank 0 of a 2-rank 1F1B sends every forward output"
    assert not alive_at_backward, f"outputs still alive at their backward: {alive_at_backward}"
    assert all(p.grad is not None for p in rt.params.values())


def test_fixed_turns_can_start_with_the_backward_half():
    """CUDA turns follow the program (no handover while an op is in flight): a pair whose forward input is late
    starts with its backward half, which computes until its first switch point before the forward begins."""
    from pipeline.runtime.overlap import PairRunner
    from pipeline.observability.recorder import Recorder

    runner = PairRunner(Recorder(0, torch.device("cpu"), enabled=False), torch.device("cpu"), comms=None)
    runner.dynamic = False  # as on CUDA
    order = []

    def forward():
        order.append("F0")
        runner.switch("F")
        order.append("F1")

    def backward():
        order.append("B0")
        runner.switch("B")
        order.append("B1")

    runner.run(forward, backward, f_chunk=(0, 0), b_chunk=(1, 0), first="B")
    assert order == ["B0", "F0", "B1", "F1"]
    order.clear()
    runner.run(forward, backward, f_chunk=(0, 0), b_chunk=(1, 0))
    assert order == ["F0", "B0", "F1", "B1"]


def test_pair_spans_are_process_wide_nvtx_ranges(monkeypatch):
    """nsys draws push/pop ranges per thread; the backward half's spans may begin on one thread and end on
    another (autograd's device thread on CUDA), so they are start/end ranges, closed on any thread."""
    import pipeline.observability.recorder as recorder

    calls = []

    class FakeNvtx:
        def push_range(self, *a, **k):
            calls.append(("push", threading.get_ident()))

        def pop_range(self, *a, **k):
            calls.append(("pop", threading.get_ident()))

        def start_range(self, *a, **k):
            calls.append(("start", threading.get_ident()))
            return ("id", len(calls))

        def end_range(self, rid):
            calls.append(("end", rid))

        def mark(self, *a, **k):
            pass

    monkeypatch.setattr(recorder, "_nvtx", FakeNvtx())
    from pipeline.runtime.overlap import PairRunner

    rec = recorder.Recorder(0, torch.device("cpu"))
    runner = PairRunner(rec, torch.device("cpu"), comms=None)

    def backward():
        runner.resume("B", "L3.block")
        t = threading.Thread(target=lambda: runner.switch("B"))  # a switch point on another thread
        t.start()
        t.join()

    runner.run(lambda: runner.resume("F", "L1.block"), backward, f_chunk=(0, 0), b_chunk=(1, 0))
    kinds = [c[0] for c in calls]
    assert "push" not in kinds and "pop" not in kinds, calls
    assert kinds.count("start") == 2 and kinds.count("end") == 2, calls
    assert {s.name for s in rec.spans} == {"F/s0/mb0/L1.block", "B/s1/mb0/L3.block"}


def test_the_count_read_without_cuda_reads_after_the_wait():
    """Comms.host_read on the host path reads the tensors as they are once the op completed."""
    from pipeline.distributed.comm import Comms, Handle
    from pipeline.observability.recorder import Recorder

    comms = Comms(0, Recorder(0, torch.device("cpu")), timeout_s=1.0)
    a, b = torch.tensor([1, 2]), torch.tensor([0, 0])
    read = comms.host_read(Handle(False, "A2A_DISPATCH/s0/mb0/L1.counts", "EP group"), [a, b])
    b.copy_(torch.tensor([3, 4]))  # what the exchange delivers before the read
    assert read() == [1, 2, 3, 4]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_adamw_on_cuda():
    from configs import load_config
    from pipeline.model import make_optimizer

    p = torch.nn.Parameter(torch.randn(4, device="cuda"))
    opt = make_optimizer([p], load_config("tiny").train)
    assert opt.defaults.get("fused") is True


def test_ep1_moe_reads_its_counts_through_the_runtimes_bounded_reader():
    """EP=1: every MoE layer of a stage gets the runtime's count reader (CUDA: an early pinned copy polled with the
    run's deadline, not counts.tolist() after the shared expert); on CPU the reader is a plain read of the counts."""
    from configs import parse_config
    from pipeline.distributed.expert import start_count_read
    from pipeline.model import MoE
    from pipeline.runtime.train import RankRuntime

    cfg = parse_config(tiny_config("1f1b", 2, moe=True, timeout_s=7), "test")
    rt = RankRuntime(cfg, 0, torch.device("cpu"))
    moes = [m for s in rt.executor.stages.values() for m in s.modules() if isinstance(m, MoE)]
    assert moes and all(m.count_reader is not None and m.count_reader.keywords == {"timeout_s": 7, "dev": None}
                        for m in moes)
    counts = torch.tensor([3, 0, 5])
    assert start_count_read(counts, 1.0)() == [3, 0, 5]
    rt.close()
