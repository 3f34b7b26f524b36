"""The runtime's CUDA branch, executed on CPU under the emulated CUDA device (pipeline.device.emulated), and its
programs replayed under CUDA's and NCCL's rules (traces.analysis.cuda_replay, docs/cuda_program.md).

* Every multi-rank case of the equivalence grid (5 schedules x {pp4, pp2 x dp2 x EP2 MoE} x F&B overlap on/off, and
  a MoE model with >= 3 MoE layers per stage) runs one step under emulation: its loss equals the plain gloo run's
  and the replay of its programs is `ok`.
* Mutations of the CUDA rules the runtime follows, each caught by the replay of an emulated run: blocking streams
  (the step-1 cycle of 1F1B on two ranks), one end stream shared by all ops in flight (GPipe with EP: the MoE count
  read queued behind an early receive hangs the run, whose programs then name the cycle), an all-to-all input
  released before its end (a hazard: the caching allocator may reuse it while NCCL reads it), a warm-up that skips
  the all-to-all connections (a host-blocking connection inside step 1).
* Ranks on different nodes share no filesystem: rank 0 gathers the per-rank trace files over the world group.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from unittest import mock

import pytest

from _pipeline_helpers import check_ok, tiny_config
from rank_pool import launch

TOL = 1e-9
KINDS = ("gpipe", "1f1b", "zb1p", "dualpipe", "dualpipev")
LAYOUTS = {"pp4": dict(ranks=4), "pp2-dp2-ep2": dict(ranks=2, dp=2, ep=2, moe=True)}


def _mutation(name: str | None):
    """A context that breaks one CUDA rule of the runtime (inside a rank process)."""
    import torch.distributed as dist

    import pipeline.distributed.comm as comm
    import pipeline.distributed.warmup as warmup
    from pipeline.device.emulated import EmulatedCuda

    stack = contextlib.ExitStack()
    if name == "blocking-streams":  # as cudaStreamCreate made them before the fix
        real = EmulatedCuda.new_stream
        stack.enter_context(mock.patch.object(EmulatedCuda, "new_stream", lambda self, role, priority=0,
                                              blocking=False: real(self, role, priority, role in ("comm", "end"))))
    elif name == "shared-end-stream":  # one stream for every op's end event and host copy
        real_acquire = comm._EndStreams.acquire

        def acquire(self):
            if not hasattr(self, "_one"):
                self._one = real_acquire(self)
            return self._one
        stack.enter_context(mock.patch.object(comm._EndStreams, "acquire", acquire))
    elif name and name.startswith("a2a-noncontiguous"):  # all-to-all inputs made for the call (send.contiguous())
        import pipeline.distributed.expert as expert

        real_exchange = expert.ExpertComm.exchange
        stack.enter_context(mock.patch.object(expert.ExpertComm, "exchange", lambda self, send, *a, **kw: real_exchange(
            self, send.t().contiguous().t() if send.dim() == 2 else send, *a, **kw)))
        if name.endswith("-released"):  # and the Handle of a collective keeps none of its tensors
            real_handle = comm.Handle
            stack.enter_context(mock.patch.object(comm, "Handle", lambda *a, **kw: real_handle(
                *a, **({**kw, "wire": None} if isinstance(a[2], str) else kw))))
    elif name == "warmup-skips-a2a":  # EP groups warmed with an all-reduce only
        real_collective = warmup.collective

        def collective(fn, *args, **kw):
            if fn is dist.all_to_all_single:
                return real_collective(dist.all_reduce, args[1], **kw)
            return real_collective(fn, *args, **kw)
        stack.enter_context(mock.patch.object(warmup, "collective", collective))
    elif name is not None:
        raise ValueError(name)
    return stack


def _step_worker(rank, world, cfg_dicts, program_dirs, mutation=None):
    """One step of each config; returns the losses. A config with train.emulate_cuda writes its program into its
    folder."""
    import torch

    from configs import parse_config
    from pipeline.runtime.train import RankRuntime, make_groups

    losses = []
    with _mutation(mutation):
        for d, folder in zip(cfg_dicts, program_dirs):
            cfg = parse_config(d)
            groups = make_groups(cfg, rank, world, torch.device("cpu"))
            rt = RankRuntime(cfg, rank, torch.device("cpu"), groups=groups, record=False)
            try:
                rt.align_clocks()
                losses.append(rt.step(0).loss)
            except Exception:
                rt.close(program_dir=Path(folder) if folder else None, complete=False)
                raise
            rt.close(program_dir=Path(folder) if folder else None)
    return losses


def _replay(folder: Path, **rules):
    from traces.analysis.cuda_replay import Rules, replay_programs
    from traces.formats.cuda_program import load_programs

    return replay_programs(load_programs(folder), Rules(**rules))


def _emulated(cfg: dict) -> dict:
    return {**cfg, "train": {**cfg["train"], "emulate_cuda": True}}


def _cases() -> list[tuple[str, dict]]:
    out = []
    for layout, kw in LAYOUTS.items():
        for kind in KINDS:
            for ov in ((True, False) if kind in ("dualpipe", "dualpipev") else (True,)):
                cfg = tiny_config(kind, steps=1, dtype="float64", overlap=ov, **kw)
                out.append((f"{kind}-{layout}{'' if ov else '-serial'}", cfg))
    # >= 3 MoE layers on every stage: 16 blocks on DualPipeV's 4 stages (the first block dense)
    out.append(("dualpipev-pp2-dp2-ep2-16blocks", tiny_config("dualpipev", steps=1, dtype="float64", blocks=16,
                                                              **LAYOUTS["pp2-dp2-ep2"])))
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_grid_runs_under_emulated_cuda_with_gloos_losses_and_replays_ok(layout, tmp_path):
    cases = [(name, cfg) for name, cfg in _cases() if layout in name]
    cfgs = [c for _, c in cases] + [_emulated(c) for _, c in cases]
    dirs = [""] * len(cases) + [str(tmp_path / name) for name, _ in cases]
    results = launch(_step_worker, 4, (cfgs, dirs), timeout_s=560)
    check_ok(results)
    losses = results[0].value
    for i, (name, _) in enumerate(cases):
        plain, emulated = losses[i], losses[len(cases) + i]
        assert abs(plain - emulated) <= TOL * abs(plain), f"{name}: loss {emulated} under emulation, {plain} on gloo"
        res = _replay(tmp_path / name)
        assert res.ok, f"{name}: " + "\n".join(res.lines())
        assert res.launches > 0 and res.ranks == 4


@pytest.mark.timeout(200)
def test_blocking_streams_deadlock_1f1b_at_step_1_and_non_blocking_ones_do_not(tmp_path):
    """The step-1 cycle of the blocking end streams: rank 0's next forward waits (legacy default stream behind a
    blocking stream) for an early receive of rank 1's backward, which waits the same way for rank 0's forward."""
    cfg = _emulated(tiny_config("1f1b", 2, steps=1))
    for mutation in ("blocking-streams", None):
        folder = tmp_path / str(mutation)
        check_ok(launch(_step_worker, 2, ([cfg], [str(folder)], mutation), timeout_s=150))
        res = _replay(folder)
        text = "\n".join(res.lines())
        if mutation is None:
            assert res.ok, text
            continue
        assert not res.ok and res.cycle, text
        assert any("legacy default stream waits for earlier work of every blocking stream" in c for c in res.cycle)
        assert {c.split(":")[0].split(" ")[1] for c in res.cycle} == {"0", "1"}, text  # across both ranks
        assert any("RECV_B/s1/mb0 (NCCL" in c for c in res.cycle) and any("RECV_F/s0/mb1 (NCCL" in c
                                                                          for c in res.cycle), text


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mutation", ["a2a-noncontiguous", "a2a-noncontiguous-released", "warmup-skips-a2a"])
def test_a_released_all_to_all_input_and_a_short_warm_up_are_caught_by_the_replay(mutation, tmp_path):
    cfg = _emulated(tiny_config("dualpipev", steps=1, dtype="float64", blocks=16, **LAYOUTS["pp2-dp2-ep2"]))
    check_ok(launch(_step_worker, 4, ([cfg], [str(tmp_path)], mutation), timeout_s=250))
    res = _replay(tmp_path)
    text = "\n".join(res.lines())
    if mutation == "a2a-noncontiguous":  # the fix: the Handle holds the input made for the call until its end
        assert res.ok, text
        return
    assert not res.ok, f"{mutation} went unnoticed: {text}"
    if mutation.endswith("released"):
        assert any("A2A_" in p and "released" in p for p in res.problems), text
    else:
        assert any("after the warm-up" in p and "ep-" in p for p in res.problems), text


@pytest.mark.timeout(300)
def test_a_shared_end_stream_hangs_gpipe_with_ep_and_the_programs_name_the_cycle(tmp_path):
    """One end stream for every op in flight: the MoE count read's host copy queues behind an early-posted
    receive (RECV_B of the first backward), whose sender needs this rank's last forward, which waits for the
    counts. The emulated run hangs as the GPU would (each rank ends with one line); the programs each rank wrote
    where it stopped name the cycle."""
    cfg = _emulated(tiny_config("gpipe", steps=1, dtype="float64", timeout_s=4, **LAYOUTS["pp2-dp2-ep2"]))
    cfg["parallel"]["microbatches"] = 16
    results = launch(_step_worker, 4, ([cfg], [str(tmp_path)], "shared-end-stream"), timeout_s=120, grace_s=30)
    assert all(r.exitcode != 0 for r in results), "the shared end stream did not hang the run"
    res = _replay(tmp_path)
    text = "\n".join(res.lines())
    assert res.cycle, text
    assert any("D2H copy" in c or "host" in c for c in res.cycle), text
    assert any("RECV_B/" in c for c in res.cycle), text


def _trace_worker(rank, world, cfg_dict, base):
    """One recorded step, each rank's trace folder its own (as on nodes without a shared filesystem)."""
    import torch

    from configs import parse_config
    from pipeline.runtime.train import RankRuntime, make_groups

    cfg = parse_config(cfg_dict)
    rt = RankRuntime(cfg, rank, torch.device("cpu"), groups=make_groups(cfg, rank, world, torch.device("cpu")))
    rt.align_clocks()
    rt.step(0)
    path = rt.save_trace(Path(base) / f"node{rank}", world)
    rt.close(program_dir=Path(base) / f"node{rank}")
    return str(path) if path else None


@pytest.mark.timeout(200)
def test_rank_0_gathers_the_trace_files_of_ranks_on_other_nodes(tmp_path):
    from traces.formats.cuda_program import program_path
    from traces.trace import Trace

    results = launch(_trace_worker, 2, (_emulated(tiny_config("1f1b", 2, steps=1)), str(tmp_path)), timeout_s=150)
    check_ok(results)
    merged = Trace.load(results[0].value)
    assert {s.rank for s in merged.spans} == {0, 1}
    # rank 1's file reached rank 0's folder only through the gather
    assert (tmp_path / "node0" / "rank1.json").read_bytes() == (tmp_path / "node1" / "rank1.json").read_bytes()
    assert program_path(tmp_path / "node1", 1).exists()
