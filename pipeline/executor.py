"""The executor: runs one rank's lowered action list for one optimizer step.

Shape letters: T tokens of a micro-batch, n streams, C hidden, M micro-batches, P ranks.

Actions (schedules/ir.py), in list order:
* RECV_F/RECV_B: post a receive of the [T, n, C] activation / output-grad (labelled with the producer's stage);
  SEND_F/SEND_B: post a send of this rank's output / input-grad. Consecutive comm actions go out as one
  `batch_isend_irecv`; nothing waits for them here (schedules.md §6).
* F: wait only for its own input (a receive, or a local hand-off at the bottom of a V), run the stage forward.
* B: full backward. I: backward with the Linears' weight-grads deferred into the FIFO store, flushed under
  (stage, mb). W: pop the oldest group and check it is the (stage, mb) the schedule names.
* FB: forward of one chunk and full backward of another, interleaved segment by segment.
Sends are reaped as they complete after every compute action and drained at the end of the step, each with a
deadline; the step ends with checks that nothing is left over (receives, hand-offs, W groups, live chunks).
"""
from __future__ import annotations

import torch

from schedules import Kind, lower_comms
from schedules.ir import COMM_KINDS

from .data import Batch
from .p2p import Pending, PipelineError, Transport
from .partition import RankPlan, global_microbatch
from .recorder import Recorder
from .stage import ChunkRun, Stage, StageEnv
from .weight_grad import WeightGradStore


class Executor:
    def __init__(self, plan: RankPlan, stages: dict[int, Stage], *, transport: Transport, recorder: Recorder,
                 env: StageEnv, store: WeightGradStore, boundary_shape: tuple[int, int, int], dtype: torch.dtype,
                 device: torch.device, on_action=None):
        self.plan = plan
        self.rank = plan.rank
        self.schedule = lower_comms(plan.schedule)
        self.actions = self.schedule.actions[self.rank]
        self.specs = {sp.stage: sp for sp in plan.stages}
        self.stages = stages
        self.transport, self.recorder, self.env, self.store = transport, recorder, env, store
        self.shape, self.dtype, self.device = boundary_shape, dtype, device
        self.on_action = on_action
        self._reset()

    def _reset(self) -> None:
        self.runs: dict[tuple[int, int], ChunkRun] = {}
        self.mail_f: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb) -> input from a local prev stage
        self.mail_b: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb) -> output-grad from a local next stage
        self.grads_out: dict[tuple[int, int], torch.Tensor] = {}  # input-grads waiting for their SEND_B
        self.recvs: dict[tuple[Kind, int, int], Pending] = {}
        self.sends: list[Pending] = []
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)

    def _local(self, stage: int | None) -> bool:
        return stage is not None and self.specs[stage].rank == self.rank

    # -- comm ----------------------------------------------------------------------------------------------
    def _post(self, group) -> None:
        ops, tokens = [], []
        for a in group:
            name = f"{a.kind.value}/s{a.stage}/mb{a.mb}"
            if a.kind is Kind.SEND_F:
                tensor = self.runs[(a.stage, a.mb)].output
            elif a.kind is Kind.SEND_B:
                tensor = self.grads_out.pop((a.stage, a.mb))
            else:
                tensor = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            if tensor is None:
                raise PipelineError(f"rank {self.rank}: {name} has nothing to send (schedule order broken)")
            ops.append((a.kind in (Kind.SEND_F, Kind.SEND_B), name, a.peer, tensor))
            tokens.append(self.recorder.begin_async(a.kind.value, a.stage, a.mb, a.peer, f"{name}~comm"))
        for a, p, tok in zip(group, self.transport.post(ops), tokens):
            p.token = tok
            if p.is_send:
                self.sends.append(p)
            else:
                self.recvs[(a.kind, a.stage, a.mb)] = p

    def _take_recv(self, kind: Kind, producer: int, mb: int) -> torch.Tensor:
        p = self.recvs.pop((kind, producer, mb), None)
        if p is None:
            raise PipelineError(f"rank {self.rank}: needs {kind.value}/s{producer}/mb{mb} but never posted its "
                                "receive (the lowered schedule is inconsistent)")
        tensor = self.transport.wait(p)
        self.recorder.end_async(p.token)
        return tensor

    def _reap_sends(self, drain: bool = False) -> None:
        still = []
        for p in self.sends:
            if drain:
                self.transport.wait(p)
            if p.done or self.transport.poll(p):
                self.recorder.end_async(p.token)
            else:
                still.append(p)
        self.sends = still

    # -- compute halves ------------------------------------------------------------------------------------
    def _start_forward(self, stage: int, mb: int, batch: Batch):
        spec = self.specs[stage]
        ids, labels = batch.microbatch(global_microbatch(self.plan, spec.pipeline, mb))
        if spec.has_embed:
            inp = ids.to(self.device)
        elif self._local(spec.prev):
            inp = self.mail_f.pop((stage, mb))
        else:
            inp = self._take_recv(Kind.RECV_F, spec.prev, mb)
        run = ChunkRun(stage, mb)
        self.runs[(stage, mb)] = run
        lab = labels.to(self.device) if spec.has_head else None
        return run, self.stages[stage].forward_steps(run, inp, lab, self.env)

    def _finish_forward(self, run: ChunkRun) -> None:
        spec = self.specs[run.stage]
        if spec.has_head:
            self.loss_sum += run.loss.float()
        elif self._local(spec.next):
            self.mail_f[(spec.next, run.mb)] = run.output

    def _start_backward(self, stage: int, mb: int):
        spec = self.specs[stage]
        run = self.runs.pop((stage, mb), None)
        if run is None:
            raise PipelineError(f"rank {self.rank}: backward of s{stage}/mb{mb} before its forward")
        if spec.has_head:
            grad = None
        elif self._local(spec.next):
            grad = self.mail_b.pop((stage, mb))
        else:
            grad = self._take_recv(Kind.RECV_B, spec.next, mb)
        return run, self.stages[stage].backward_steps(run, grad, self.env)

    def _finish_backward(self, run: ChunkRun) -> None:
        spec = self.specs[run.stage]
        if spec.has_embed:
            return
        if self._local(spec.prev):
            self.mail_b[(spec.prev, run.mb)] = run.input_grad
        else:
            self.grads_out[(run.stage, run.mb)] = run.input_grad
        run.output = None

    # -- actions -------------------------------------------------------------------------------------------
    def _compute(self, a, batch: Batch) -> None:
        rec, kind = self.recorder, a.kind
        if kind is Kind.F:
            run, steps = self._start_forward(a.stage, a.mb, batch)
            with rec.range("F", a.stage, a.mb, name=f"F/s{a.stage}/mb{a.mb}"):
                for _ in steps:
                    pass
            self._finish_forward(run)
        elif kind in (Kind.B, Kind.I):
            run, steps = self._start_backward(a.stage, a.mb)
            with rec.range(kind.value, a.stage, a.mb, name=f"{kind.value}/s{a.stage}/mb{a.mb}"):
                self.store.enabled = kind is Kind.I
                try:
                    for _ in steps:
                        pass
                finally:
                    self.store.enabled = False
                if kind is Kind.I:
                    self.store.flush((a.stage, a.mb))
            self._finish_backward(run)
        elif kind is Kind.W:
            with rec.range("W", a.stage, a.mb, name=f"W/s{a.stage}/mb{a.mb}"):
                label = self.store.pop()
            if label != (a.stage, a.mb):
                raise PipelineError(f"rank {self.rank}: W/s{a.stage}/mb{a.mb} popped the weight-grads of "
                                    f"s{label[0]}/mb{label[1]}; the W queue must be FIFO in I order")
        elif kind is Kind.FB:
            self._overlapped(a, batch)
        else:
            raise PipelineError(f"rank {self.rank}: unknown action {a}")

    def _overlapped(self, a, batch: Batch) -> None:
        """F of (stage, mb) and full B of (b_stage, b_mb), interleaved one segment at a time, forward first."""
        rec = self.recorder
        run_f, steps_f = self._start_forward(a.stage, a.mb, batch)
        run_b, steps_b = self._start_backward(a.b_stage, a.b_mb)
        name = f"FB/s{a.stage}/mb{a.mb}+s{a.b_stage}/mb{a.b_mb}"
        with rec.range("FB", a.stage, a.mb, partner=(a.b_stage, a.b_mb), name=name):
            tf = rec.begin("F", a.stage, a.mb, name=f"F/s{a.stage}/mb{a.mb}", nvtx=False)
            tb = rec.begin("B", a.b_stage, a.b_mb, name=f"B/s{a.b_stage}/mb{a.b_mb}", nvtx=False)
            live = [steps_f, steps_b]
            while live:
                for gen in list(live):
                    if next(gen, StopIteration) is StopIteration:
                        live.remove(gen)
                        rec.end(tf if gen is steps_f else tb, pop=False)
        self._finish_forward(run_f)
        self._finish_backward(run_b)

    def run_step(self, batch: Batch) -> torch.Tensor:
        """Execute every action of this rank for one step; returns this rank's summed loss contributions."""
        self._reset()
        acts, i = self.actions, 0
        while i < len(acts):
            a = acts[i]
            if self.on_action is not None:
                self.on_action(i, a)
            if a.kind in COMM_KINDS:
                j = i
                while j < len(acts) and acts[j].kind in COMM_KINDS:
                    j += 1
                self._post(acts[i:j])
                i = j
                continue
            self._compute(a, batch)
            if self.sends:
                self._reap_sends()
            i += 1
        self._reap_sends(drain=True)
        self._check_clean()
        return self.loss_sum

    def _check_clean(self) -> None:
        leftovers = {"receives": list(self.recvs), "hand-offs": list(self.mail_f) + list(self.mail_b),
                     "unsent grads": list(self.grads_out), "chunks without backward": list(self.runs)}
        bad = {k: v for k, v in leftovers.items() if v}
        if bad or len(self.store):
            raise PipelineError(f"rank {self.rank}: step ended with leftovers {bad}, "
                                f"{len(self.store)} W groups; the schedule is incomplete")
