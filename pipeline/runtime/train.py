"""The training loop of one rank: build its stages, run steps through the executor, reduce, step AdamW.

Shape letters: T tokens per micro-batch, n streams, C hidden, M micro-batches, P pipeline ranks, D replicas.

`RankRuntime` owns everything one rank needs (plan, stages, optimizer, transport, recorder, saved-tensor
accounting, F&B pair runner, expert-parallel exchanges, gradient reducer, executor); the process groups
(pipeline.distributed.layout, from a DeviceMesh), rank and device are passed in, never read from globals. One step: zero
grads, run the rank's actions (each stage's gradients are all-reduced over its data-parallel and DualPipe
mirrored copies as soon as its last backward work is done), wait for those reductions, all-reduce the loss,
AdamW. Rank 0 prints one progress line per step: loss, step time (max over ranks), tokens/s and peak memory
(saved activations per rank; plus CUDA allocator peak or host RSS).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the type of every `cfg` here; configs is imported where it is used
    from configs import RunConfig

import resource
import socket
import zlib
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from configs import recompute_block_size
from schedules import build, lower_comms
from schedules.registry import trace_meta
from traces.nccl_rules import VIEW_OF_RULES
from kernels import residual_spec as rs
from kernels import single_pass

from pipeline.device.layer import device_layer
from pipeline.distributed.comm import Comms
from pipeline.distributed.errors import PipelineError
from pipeline.data import Batch, load_tokens, make_batch
from pipeline.runtime.executor import Executor
from pipeline.distributed.expert import ExpertComm
from pipeline.distributed.grad_reduce import GradReducer
from pipeline.distributed.tied import join_tie_groups
from pipeline.distributed.layout import Layout, ParallelGroups, build_groups
from pipeline.runtime.boundary import BoundaryLayout
from pipeline.runtime import nonfinite
from pipeline.runtime.gc_control import manual_gc
from pipeline.runtime.saved_tensors import SavedTensors
from pipeline.model import activation_dtype, make_optimizer, param_dtype
from pipeline.runtime.overlap import PairRunner
from pipeline.distributed.collective import collective, gather_files, group_device, synchronize
from pipeline.distributed.warmup import warm_up
from pipeline.observability.diagnostics_log import DiagnosticsLog
from pipeline.observability.diagnostics_probe import StepProbe, first_microbatches
from pipeline.distributed.p2p import Transport, process_group_timeout_s
from pipeline.distributed.p2p_protocol import P2PTransport
from pipeline.partition import chunk_count, plan_rank
from pipeline.observability.recorder import Recorder, merge_rank_traces, rank_trace_path
from pipeline.runtime.stage import Stage, StageEnv
from pipeline.runtime.user_stage import UserStage, agreed_block_costs, run_note
from pipeline.user_materialise import materialise, on_meta
from pipeline.user_model import UserModel
from pipeline.weight_grad import WeightGradStore


@dataclass
class StepStats:
    step: int
    loss: float
    step_time_s: float
    tokens_per_s: float
    peak_act_bytes: int  # max over ranks of saved-for-backward bytes (incl. a recompute block's transient)
    peak_mem_bytes: int  # max over ranks: CUDA allocator peak, or process max RSS on CPU
    skipped: str | None = None  # --skip-nonfinite: why this step made no update (pipeline.runtime.nonfinite)
    skipped_total: int = 0  # steps skipped so far in this run

    def line(self, total_steps: int) -> str:
        mib = 1 << 20
        act = f"{self.peak_act_bytes / mib:.2f} MiB" if self.peak_act_bytes else "- (counted with --trace-dir)"
        skip = f"  SKIPPED ({self.skipped.split(': ', 1)[-1]}; {self.skipped_total} skipped)" if self.skipped else ""
        return (f"step {self.step + 1}/{total_steps}  loss {self.loss:.6f}  step_time {self.step_time_s * 1e3:.1f} ms  "
                f"tokens/s {self.tokens_per_s:,.0f}  peak_act {act}  "
                f"peak_mem {self.peak_mem_bytes / mib:.1f} MiB{skip}")


def first_step_deadline(cfg: RunConfig, device: torch.device) -> float:
    """The first step's deadline: on a GPU every rank JIT-compiles its Triton kernels and NCCL connects what the
    warm-up did not in it, so it is train.first_step_timeout_s when that is longer; elsewhere train.timeout_s."""
    if device.type == "cuda":
        return max(cfg.train.timeout_s, cfg.train.first_step_timeout_s)
    return cfg.train.timeout_s


def pick_device(cfg: RunConfig, local_rank: int) -> torch.device:
    want = cfg.train.device
    if cfg.train.emulate_cuda:
        if want == "cuda":
            raise ValueError("train.emulate_cuda (--emulate-cuda) runs the CUDA path on CPU tensors: use --device "
                             "cpu or auto, or drop --emulate-cuda on a GPU")
        return torch.device("cpu")
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("train.device: 'cuda' requested but torch.cuda.is_available() is False")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


class RankRuntime:
    """One rank of a run. `groups`: its place in the layout and its process groups
    (pipeline.distributed.layout.build_groups);
    None = no process group at all (a stage benchmark with a loopback transport). F&B pairs run overlapped unless
    `parallel.overlap` is false. `record`: keep a trace of spans; `count_activations` (default: as `record`):
    count saved activation bytes per step (instrumentation with a per-tensor cost; peak_act is 0 without it)."""

    def __init__(self, cfg: RunConfig, rank: int, device: torch.device, *, groups: ParallelGroups | None = None,
                 staged: bool = False, on_action=None, record: bool = True, count_activations: bool | None = None,
                 model: UserModel | None = None, probe=None):
        """`model`: a user's model (pipeline.user_model) instead of the built-in one; `cfg.model` then describes
        it (pipeline.launch.user_config.user_config). `probe`: check-split's boundary probe (UserStage)."""
        par = cfg.parallel
        layout = Layout.of(cfg)
        if groups is None:
            layout.check(cfg)
            groups = ParallelGroups.single(layout, rank)
        self.cfg, self.rank, self.device, self.groups = cfg, groups.rank, device, groups
        schedule = build(par.schedule, par.ranks, par.microbatches_per_replica)
        world = dist.get_world_size(groups.world_group) if groups.world_group is not None else 1
        # CUDA, or the emulated CUDA device: every stream, event and stream-ordered wait goes through it
        self.dev = device_layer(device, emulate=cfg.train.emulate_cuda, rank=groups.rank, world=world,
                                timeout_s=cfg.train.timeout_s)
        chunks = None if model is None else model.chunks(chunk_count(par.schedule, schedule),
                                                         agreed_block_costs(model, cfg, device, groups, self.dev))
        self.plan = plan_rank(cfg, groups.pp_rank, schedule, dp_rank=groups.dp_rank, chunks=chunks)
        self.dtype = activation_dtype(cfg.train.dtype)
        self.store = WeightGradStore()
        n = cfg.model.residual.n
        self.recorder = Recorder(groups.rank, device, enabled=record, dev=self.dev)
        self.timeout_s = cfg.train.timeout_s
        self.first_timeout_s = first_step_deadline(cfg, device)
        # gloo P2P completion is watched (waiter threads) only where the runtime uses it: an F&B pair that hands the
        # turn over while a receive is in flight (expert parallelism). Elsewhere, recording included, it is not:
        # the threads' wake-ups take CPU time from the step's compute, and such a trace then says that its P2P
        # spans end where a wait saw them done (meta p2p_completion), which traces.analysis.comm_overlap respects.
        # NCCL (a CUDA run with a process group, not host-staged): stream-ordered waits and comm-stream spans
        nccl = self.dev is not None and not staged and groups.world_group is not None
        # (a user model whose blocks expose phases hands the turn over the same way)
        phased = model is not None and model.has_phases()
        self.comms = Comms(groups.rank, self.recorder, self.timeout_s, watch_p2p=groups.ep_groups is not None or phased,
                           stream_ordered=nccl, dev=self.dev, names=groups.name_of)
        # the device layer posts and waits the runtime's own collectives only where works are NCCL's (or the
        # emulated device's): a host-staged CUDA run's gloo works are waited on the host, as on CPU
        self.posting_dev = self.dev if nccl else None
        self.pair = (PairRunner(self.recorder, device, self.comms, filler=self.store.take_one, dev=self.dev)
                     if par.overlap else None)
        self.expert = None
        if groups.ep_groups is not None:
            self.expert = ExpertComm(groups.ep_groups, layout.ep, groups.ep_rank, self.comms, self.pair,
                                     names={side: groups.name_of(g) for side, g in groups.ep_groups.items()})
        if model is not None:  # a user model: its recompute units are its stages' (UserStage)
            if on_meta(model):  # built on the meta device: this rank's pieces only, on the host, then moved
                materialise(model, {p for sp in self.plan.local() for p in sp.pieces}, torch.device("cpu"),
                            cfg.train.seed)
            self.rc_block = None
            # a state of several tensors (UserModel.extra_state) crosses each boundary as one packed message
            self.boundary = BoundaryLayout.of(model.state_parts(self.dtype), par.tokens_per_microbatch) \
                if model.extra_state else None
            stages = {sp.stage: UserStage(sp, model, dtype=self.dtype, microbatches=par.microbatches, probe=probe,
                                          store=self.store, recompute=cfg.recompute, boundary=self.boundary)
                      for sp in self.plan.local()}
        else:
            # recompute blocks per stage: Eq. 20 over the stage's own sub-layers (what the rank holds), as the
            # cost model prices it; blocks never cross a stage boundary
            rc_blocks = {sp.stage: recompute_block_size(cfg.recompute, 2 * len(sp.blocks), n)
                         for sp in self.plan.local()}
            self.rc_block = max((b for b in rc_blocks.values() if b is not None), default=None)
            self.boundary = None
            stages = {sp.stage: Stage(sp, cfg, store=self.store, dtype=self.dtype, rc_block=rc_blocks[sp.stage],
                                      expert=self.expert, dev=self.dev) for sp in self.plan.local()}
        self.stages = {s: st.to(device=device, dtype=param_dtype(cfg.train.dtype)) for s, st in stages.items()}
        self.params: dict[str, torch.nn.Parameter] = {}
        for st in self.stages.values():
            for name, p in st.named_parameters():
                # a user model's tied parameter is one object in every local stage that holds it: one copy here
                if name in self.params and self.params[name] is not p:
                    raise RuntimeError(f"rank {rank}: parameter {name} held by two local stages")
                self.params[name] = p
        self.optimizer = make_optimizer(self.params.values(), cfg.train)
        self.saved = SavedTensors(self.params.values(), counting=record if count_activations is None
                                  else count_activations)
        hp = self.dev.new_stream("hp", priority=-1) if self.dev is not None else None
        self.hp = hp
        self.tokens_per_mb = par.tokens_per_microbatch
        self.total_tokens = self.tokens_per_mb * par.microbatches
        self.env = StageEnv(self.saved, self.recorder, self.total_tokens, hp, self.dev)
        self.strict = strict_transport(cfg, groups, device, staged)
        self.comms.strict = self.strict
        self.transport = Transport(groups.pp_rank, device, self.comms, staged=staged,
                                   groups=groups if groups.world_group is not None else None, strict=self.strict)
        # the gradient reduction follows the rank's lowered actions (the executor runs the same list)
        actions = lower_comms(self.plan.schedule).actions[self.plan.rank]
        # a user model's parameters held on several ranks: the groups that sum their gradients
        ties = join_tie_groups(model.ties(), self.plan.stages, groups) if model is not None else []
        self.grads_reducer = GradReducer(self.plan, self.stages, groups, self.comms, actions, ties)
        self.executor = Executor(self.plan, self.stages, transport=self.transport, recorder=self.recorder,
                                 env=self.env, store=self.store,
                                 boundary_shape=(self.tokens_per_mb, n, boundary_width(cfg)) if self.boundary is None
                                 else (self.boundary.nbytes,),
                                 boundary_dtype=None if self.boundary is None else torch.uint8,
                                 dtype=self.dtype, device=device, pair=self.pair, expert=self.expert,
                                 grads=self.grads_reducer if self.grads_reducer.active else None,
                                 on_action=on_action, who=f"rank {groups.rank}")
        # every communicator connected once, in one global order, before any step posts (NCCL connects lazily)
        self.warmed_up = warm_up(groups, device, self.timeout_s, self.strict, self.posting_dev)
        self.tokens = load_tokens(cfg.train.data) if cfg.train.data != "synthetic" else None
        self.start_step = 0
        self._stepped = False  # has a step run (the first has its own deadline)
        self.skipped = 0  # steps skipped for non-finite numbers (train.skip_nonfinite)

    # -- per step ------------------------------------------------------------------------------------------
    def step(self, step: int, diagnostics=None) -> StepStats:
        """One optimizer step; `diagnostics` (pipeline.observability.diagnostics_log.DiagnosticsLog) logs it if it
        wants."""
        cfg = self.cfg
        first = not self._stepped
        self._stepped = True
        limit = self.first_timeout_s if first else self.timeout_s
        self.comms.timeout_s = limit  # every wait of the step (the executor's, the pair's, the expert exchanges')
        batch = make_batch(cfg, step, self.tokens)
        if self.dev is not None:  # ids and labels go to the device without a host sync per micro-batch
            batch = Batch(self.dev.pinned(batch.inputs), self.dev.pinned(batch.labels))
        self.env.diagnostics = None
        if diagnostics is not None and diagnostics.wants_step(step):
            self.env.diagnostics = StepProbe(diagnostics, step, first_microbatches(self.executor.actions))
        self.optimizer.zero_grad(set_to_none=True)
        self.saved.reset_peak()
        if self.dev is not None:
            self.dev.reset_peak_memory()
        started = time.perf_counter()
        with self.recorder.range("step", None, None, name=f"step/{step}"):
            loss_sum = self.executor.run_step(batch)
            if self.grads_reducer.active:
                self.grads_reducer.finish()
            nonfinite.inject(self.rank, step, self.params.values())
            bad = nonfinite.verdict(self, loss_sum, step)  # every rank the same answer
            if bad is not None and not cfg.train.skip_nonfinite:
                raise nonfinite.NonFiniteError(f"{bad}: the run stops before its optimizer step (parameters and "
                                               "optimizer state are those after the previous step; "
                                               "--skip-nonfinite skips such steps)")
            if self.strict is not None:  # before the statistics exchange: no rank leaves while another compares
                self.strict.check_collectives()
            if bad is None:
                with self.recorder.range("OPT", None, None, name="OPT"):
                    self.optimizer.step()
            else:
                self.skipped += 1
                self.optimizer.zero_grad(set_to_none=True)
            # The step's one wait for the device (the step time needs it); the loss travels with the statistics
            # below, so no collective waits on the GPU's compute before this.
            synchronize(self.dev, (self.hp, self.comms.stream), limit, "the end-of-step synchronize",
                        self.rank)
        elapsed = time.perf_counter() - started
        self.env.diagnostics = None
        self.recorder.flush_step(limit)
        mem = self.dev.peak_memory() if self.dev is not None else None
        if mem is None:
            mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        world = self.groups.world_group
        where = group_device(world, self.device)  # NCCL gathers cuda tensors only
        host = torch.tensor([elapsed, float(self.saved.peak), float(mem)], dtype=torch.float64)
        mine = torch.cat([loss_sum.detach().reshape(1).to(where, torch.float64), host.to(where)])
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(world))]
        collective(dist.all_gather, every, mine, what="the step statistics all-gather", rank=self.rank,
                   timeout_s=limit, group=world, dev=self.posting_dev)
        rows = torch.stack(every).tolist()  # one host read: [rank][loss, seconds, activation bytes, peak bytes]
        # the loss: summed on the host in rank order (the same on every backend); the rest: the slowest rank's
        loss = sum(r[0] for r in rows)
        t, act, peak = (max(r[k] for r in rows) for k in (1, 2, 3))
        return StepStats(step, loss, t, self.total_tokens / t, int(act), int(peak), bad, self.skipped)

    def grads(self) -> dict[str, torch.Tensor]:
        return {k: p.grad.detach().cpu().clone() for k, p in self.params.items() if p.grad is not None}

    # -- whole run -----------------------------------------------------------------------------------------
    def use_transport(self, transport: P2PTransport) -> None:
        """Run the pipeline's P2P over `transport` instead (a loopback for one rank alone: benchmarks, tests)."""
        self.transport = self.executor.transport = transport

    def close(self, program_dir: Path | None = None, complete: bool = True) -> None:
        """Stop this runtime's helper threads (the F&B pair's backward half, the strict transport's queues and
        heads publisher, gloo P2P waiters): a process that runs several runtimes in turn (variants, the tests'
        rank pool) must not keep every earlier one's threads waking up. The emulated CUDA device writes its
        program into `program_dir` (the run's trace folder); `complete=False` after a failure (it ends where this
        rank stopped: `mhcpipe check-comm --cuda` then names the cycle it was part of)."""
        if self.dev is not None:
            self.dev.close(program_dir, complete)
        if self.pair is not None:
            self.pair.close()
        if self.strict is not None:
            self.strict.close()
        if self.comms.waiter is not None:
            self.comms.waiter.close()

    def align_clocks(self) -> int:
        """Common time zero of the ranks' spans: on one host the earliest rank's monotonic clock reading after a
        barrier (the clocks agree, the barrier's exit does not), else each rank's own reading after it.
        Returns that zero (a `time.perf_counter_ns` value), for other recorders of this rank to share."""
        world = self.groups.world_group
        collective(dist.barrier, what="the start barrier", rank=self.rank, timeout_s=self.timeout_s, group=world,
                   dev=self.posting_dev)
        now = time.perf_counter_ns()
        mine = torch.tensor([zlib.crc32(socket.gethostname().encode()), now], dtype=torch.int64,
                            device=group_device(world, self.device))
        seen = [torch.empty_like(mine) for _ in range(dist.get_world_size(world))]
        collective(dist.all_gather, seen, mine, what="the clock exchange", rank=self.rank, timeout_s=self.timeout_s,
                   group=world, dev=self.posting_dev)
        one_host = len({int(t[0]) for t in seen}) == 1
        zero = min(int(t[1]) for t in seen) if one_host else now
        self.recorder.align(zero)
        return zero

    def save_trace(self, trace_dir: Path, world: int) -> Path | None:
        """Write this rank's spans; rank 0 gathers every rank's file over the world group (ranks on other nodes
        write to their own disks: no shared filesystem is assumed) and merges them into trace.json (trace.npz:
        train.trace_format)."""
        trace_dir = Path(trace_dir)
        par = self.cfg.parallel
        layout = self.groups.layout
        meta = {"source": "measured", "schedule": trace_meta(par.schedule, par.ranks, par.microbatches_per_replica),
                "pipelines": [list(chain) for chain in self.plan.schedule.pipelines],  # stage chains (traces)
                "layout": {"pp": layout.pp, "dp": layout.dp, "ep": layout.ep,
                           "overlap": self.pair is not None},
                # every block on a communication handle is a WAIT span (traces.analysis.comm_overlap)
                "wait_spans": True,
                "p2p_completion": "stamped" if self.comms.waiter is not None else "at the wait",
                "time_unit": "us", "device": str(self.device), "model": self.cfg.model.name,
                "residual": {"variant": self.cfg.model.residual.variant, "n": self.cfg.model.residual.n},
                "recompute_block": self.rc_block, "tokens_per_microbatch": self.tokens_per_mb,
                "comm_groups": self.groups.comm_groups() if self.groups.world_group is not None else {},
                "comm_rules": comm_rules_of(self.cfg)}
        fmt = self.cfg.train.trace_format
        mine = self.recorder.save(rank_trace_path(trace_dir, self.rank, fmt), meta)
        files = gather_files(mine, self.groups.world_group, self.device, self.rank, self.timeout_s,
                            self.posting_dev)
        if self.rank == 0:
            for r, data in enumerate(files):
                if r != 0:
                    rank_trace_path(trace_dir, r, fmt).write_bytes(data)
            return merge_rank_traces([rank_trace_path(trace_dir, r, fmt) for r in range(world)],
                                     trace_dir / f"trace.{fmt}", meta)
        return None


def comm_rules_of(cfg: RunConfig) -> str:
    """The rules the run's P2P follows: train.comm_rules, at least 'nccl' under train.emulate_cuda. The emulated
    device completes what gloo completes, and gloo completes a send before its receive is posted and a batch out
    of its communicator's order, which no NCCL launch does: a program recorded on those completions holds host
    waits and reused streams a GPU never has (docs/cuda_program.md)."""
    rules = cfg.train.comm_rules
    return "nccl" if cfg.train.emulate_cuda and rules == "backend" else rules


def strict_transport(cfg: RunConfig, groups: ParallelGroups, device: torch.device, staged: bool):
    """The NCCL-rules transport of comm_rules_of(cfg) 'nccl' / 'nccl-pair' (None for 'backend'), for a run with a
    process group on gloo: a CPU run, or a host-staged one."""
    rules = comm_rules_of(cfg)
    if rules == "backend" or groups.world_group is None:
        return None
    if device.type == "cuda" and not staged:
        raise ValueError(f"train.comm_rules {rules!r} (--comm-rules) runs gloo P2P under NCCL's rules; this "
                         "run is on NCCL already: use --transport auto, or --device cpu")
    from pipeline.distributed.strict_transport import StrictTransport

    return StrictTransport(groups.rank, dist.get_world_size(groups.world_group), cfg.train.timeout_s,
                           view=VIEW_OF_RULES[rules])


def make_groups(cfg: RunConfig, rank: int, world: int, device: torch.device, staged: bool = False) -> ParallelGroups:
    """Check the layout against the world and create its meshes and groups (collective: every rank calls it);
    with train.cpu_bind on a CPU run, bind this process to its cores first."""
    layout = Layout.of(cfg)
    layout.check(cfg, world)
    if cfg.train.cpu_bind and device.type == "cpu":
        import os

        from pipeline.runtime.cpu_binding import bind_cpus

        bind_cpus(int(os.environ.get("LOCAL_RANK", rank)), int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if staged and (layout.dp > 1 or layout.ep > 1):
        raise ValueError("--transport host stages pipeline P2P through host memory only; data and expert "
                         "parallelism need a GPU per rank (use --dp 1 --ep 1 with it)")
    device_type = "cuda" if device.type == "cuda" and not staged else "cpu"
    if cfg.parallel.p2p_groups == "shared" and device_type == "cuda":
        raise ValueError("parallel.p2p_groups 'shared' (--p2p-groups shared) puts all of a pipeline's P2P on one "
                         "communicator, which deadlocks under NCCL; it exists to reproduce that on gloo "
                         "(--comm-rules nccl); use 'channel'")
    backend = "nccl" if device_type == "cuda" else "gloo"
    return build_groups(layout, rank, device_type, cfg.parallel.p2p_groups,
                        timeout_s=process_group_timeout_s(backend, cfg.train.timeout_s,
                                                          cfg.train.first_step_timeout_s))


def train(cfg: RunConfig, rank: int, world: int, device: torch.device, *, trace_dir: Path | None = None,
          diagnostics_dir: Path | None = None, checkpoint_dir: Path | None = None, resume: bool = False,
          staged: bool = False, log=print, on_action=None, model: UserModel | None = None,
          probe=None) -> list[StepStats]:
    """Run cfg.train.steps steps (from the checkpoint's next step with `resume`) in an initialized process group.
    `model`: a user's model (pipeline.user_model) instead of the built-in one; `probe`: see RankRuntime."""
    from pipeline.checkpoint import dcp  # torch.distributed.checkpoint's import: only for runs that use it
    from pipeline.checkpoint.async_save import Checkpointer

    groups = make_groups(cfg, rank, world, device, staged)
    rt = RankRuntime(cfg, rank, device, groups=groups, staged=staged, on_action=on_action,
                     record=trace_dir is not None, model=model, probe=probe)
    if model is not None and rank == 0:
        note = run_note({a.kind.value for a in rt.executor.actions}, rt.pair is not None, rt.stages.values())
        if note:
            log(note)
    if resume:
        if checkpoint_dir is None:
            raise ValueError("--resume needs --checkpoint-dir")
        rt.start_step = dcp.load(Path(checkpoint_dir), rt)
    history = []
    steps = cfg.train.steps
    diagnostics_dir = diagnostics_dir or trace_dir
    diag = diagnostics_log(cfg, rank) if diagnostics_dir is not None else None
    saves = Checkpointer(Path(checkpoint_dir), rt) if checkpoint_dir is not None else None
    try:
        with manual_gc(cfg.train.gc_interval) as collect:
            rt.align_clocks()
            for k in range(rt.start_step, steps):
                _test_kill(rank, k)
                stats = rt.step(k, diag)
                history.append(stats)
                if rank == 0:
                    log(stats.line(steps))
                if saves is not None:
                    saves.after_step(k)
                collect(k)
            if saves is not None:
                saves.finish()
    except PipelineError:
        if rt.dev is not None and trace_dir is not None:  # the emulated device's program, up to where it stopped
            rt.dev.close(trace_dir, complete=False)
        raise
    said = saves.summary(sorted(s.step_time_s for s in history)[len(history) // 2]) \
        if saves is not None and history else None
    if said and rank == 0:
        log(said)
    if trace_dir is not None:
        path = rt.save_trace(trace_dir, world)
        if path is not None:
            log(f"trace: {path}")
    if diag is not None:
        diag.save(Path(diagnostics_dir))
        if rank == 0:
            log(f"diagnostics: {diagnostics_dir}/diagnostics_rank*.json (mhcpipe diagnose {diagnostics_dir})")
    rt.close(program_dir=trace_dir)
    if trace_dir is not None and rt.dev is not None and rt.dev.name == "emulated-cuda" and rank == 0:
        log(f"CUDA programs: {trace_dir}/cuda_program_rank*.json (mhcpipe check-comm --cuda {trace_dir})")
    return history


KILL_ENV = "MHCPIPE_TEST_KILL"


def _test_kill(rank: int, step: int) -> None:
    """Test hook: MHCPIPE_TEST_KILL="<rank>:<step>" kills that rank (SIGKILL, as an OOM killer or a lost node
    would) before that step, in the job's first attempt only (torchrun's TORCHELASTIC_RESTART_COUNT 0), so a
    restarted job runs on."""
    import os
    import signal

    spec = os.environ.get(KILL_ENV, "")
    if spec and spec.split(":") == [str(rank), str(step)] and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os.kill(os.getpid(), signal.SIGKILL)


def diagnostics_log(cfg: RunConfig, rank: int) -> DiagnosticsLog | None:
    """The run's stream-collapse diagnostics collector (train.diagnostics_every), or None when off."""
    every = cfg.train.diagnostics_every
    if not every:
        return None
    log = DiagnosticsLog(every, rank)
    log.final_step(cfg.train.steps - 1)
    return log


def boundary_width(cfg: RunConfig) -> int:
    """Last dim of what crosses a stage boundary: C, or C + the packed coefficient for mhc-sp (kernels.single_pass)."""
    if rs.variant(cfg.model.residual.variant).carries_coefficient:
        return single_pass.boundary_width(cfg.model.hidden, activation_dtype(cfg.train.dtype))
    return cfg.model.hidden




def train_interleaved(cfgs: list, rank: int, world: int, device: torch.device, *, trace_dirs: list[Path] | None = None,
                      staged: bool = False, log=print,
                      diagnostics_dirs: list[Path] | None = None) -> list[list[StepStats]]:
    """A/B measurement: train every config in this process group, step k of each before step k+1 of any, in an
    order that reverses every step (A B B A A B ...). On a host whose speed drifts (a shared VM, a busy node) all
    variants see the same drift, so their step times compare; no variant always runs after another. The configs
    must agree on ranks and steps; each one's trace goes to its own folder, all on one time axis. Rank 0 prints
    each step's line prefixed with the variant's residual."""
    if any(c.train.emulate_cuda for c in cfgs):
        raise ValueError("--emulate-cuda records one run's CUDA program; an interleaved A/B run would mix two "
                         "programs on the same communicators: drop --interleave")
    if len({(Layout.of(c), c.train.steps) for c in cfgs}) != 1:
        raise ValueError("interleaved runs need the same layout (--pp, --dp, --ep) and train.steps in every config; "
                         "got " + ", ".join(f"{Layout.of(c)} x {c.train.steps} steps" for c in cfgs))
    groups = make_groups(cfgs[0], rank, world, device, staged)
    runtimes = [RankRuntime(c, rank, device, groups=groups, staged=staged, record=trace_dirs is not None)
                for c in cfgs]
    history: list[list[StepStats]] = [[] for _ in runtimes]
    steps = cfgs[0].train.steps
    diagnostics_dirs = diagnostics_dirs or trace_dirs
    diags = [diagnostics_log(c, rank) if diagnostics_dirs is not None else None for c in cfgs]
    with manual_gc(cfgs[0].train.gc_interval) as collect:
        zero = runtimes[0].align_clocks()
        for rt in runtimes[1:]:
            rt.recorder.align(zero)  # one time axis for every variant's trace
        for k in range(steps):
            for i in (range(len(runtimes)) if k % 2 == 0 else reversed(range(len(runtimes)))):
                stats = runtimes[i].step(k, diags[i])
                history[i].append(stats)
                if rank == 0:
                    log(f"[{cfgs[i].model.residual.label}] {stats.line(steps)}")
            collect(k)
    if trace_dirs is not None:
        for rt, trace_dir in zip(runtimes, trace_dirs):
            path = rt.save_trace(trace_dir, world)
            if path is not None:
                log(f"trace: {path}")
    for diag, diag_dir in zip(diags, diagnostics_dirs or []):
        if diag is not None:
            diag.save(Path(diag_dir))
    for rt in runtimes:
        rt.close()
    return history


def stats_dicts(history: list[StepStats]) -> list[dict]:
    return [asdict(s) for s in history]


__all__ = ["RankRuntime", "StepStats", "make_groups", "pick_device", "train",
           "train_interleaved", "stats_dicts"]
