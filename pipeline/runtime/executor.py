"""The executor: runs one rank's lowered action list for one optimizer step.

Shape letters: T tokens of a micro-batch, n streams, C hidden, M micro-batches, P ranks.

Actions (schedules/ir.py), in list order:
* RECV_F/RECV_B: post a receive of the [T, n, C] activation / output-grad (consecutive receives go out as one
  `batch_isend_irecv`); nothing waits for them here.
* SEND_F/SEND_B: a send is posted the moment its tensor exists, by the half that produced it (so an F&B's
  forward output leaves before its backward half ends, and an input-grad before its W work); the SEND action
  only checks that it was. Sends to one peer keep the lowered order (the receiver posts in that order): a send
  whose predecessors on its channel are not out yet waits for them.
* F: wait only for its own input (a receive, or a local hand-off at the bottom of a V), run the stage forward.
* B: the input-grad chain with the Linears' weight-grads deferred, the send, then the deferred weight-grads.
  I: the same without the last part: the group is flushed to the FIFO store under (stage, mb).
  W: pop the oldest group and check it is the (stage, mb) the schedule names.
* FB: the forward of one chunk and the full backward of another. With a `PairRunner` (default) they overlap:
  when their stages exchange tokens with expert-parallel all-to-alls, each half runs on its own thread,
  interleaved at every segment boundary and every all-to-all (pipeline.runtime.overlap), the backward's deferred
  weight-grads filling either half's waits and the rest run when both halves are done; without such communication
  inside the halves there is nothing to interleave, and they run one after the other, the one whose input is
  here first. Either way each half waits only for its own receive and posts its send as soon as it exists.
  Without (`--no-overlap`): F, then B, every all-to-all waited right after its post and the pair's sends posted
  after it (the serial baseline for A/B).
After each action the stages whose gradients it finished have them reduced (pipeline.distributed.grad_reduce). Sends are
reaped as they complete and drained at the end, each with a deadline; the step ends with checks that nothing is
left over (receives, hand-offs, W groups, live chunks).
"""
from __future__ import annotations

import contextlib
from collections import defaultdict

import torch


from schedules import Kind, lower_comms
from schedules.ir import COMM_KINDS
from traces.trace import span_name

from pipeline.data import Batch
from pipeline.distributed.errors import PipelineError
from pipeline.distributed.expert import ExpertComm
from pipeline.distributed.p2p import Pending
from pipeline.distributed.p2p_protocol import GradSink, P2PTransport
from pipeline.observability.recorder import Recorder
from pipeline.runtime.overlap import PairRunner
from pipeline.partition import RankPlan, global_microbatch
from pipeline.runtime.stage import ChunkRun, Stage, StageEnv
from pipeline.weight_grad import WeightGradStore


class Executor:
    def __init__(self, plan: RankPlan, stages: dict[int, Stage], *, transport: P2PTransport, recorder: Recorder,
                 env: StageEnv, store: WeightGradStore, boundary_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, pair: PairRunner | None = None, expert: ExpertComm | None = None,
                 grads: GradSink | None = None, on_action=None, who: str | None = None,
                 boundary_dtype: torch.dtype | None = None):
        """Every collaborator is given here (typed: pipeline.distributed.p2p_protocol). `who`: how errors name this
        rank (the global rank; default: the pipeline rank, which is the same without data parallelism).
        `boundary_shape` / `boundary_dtype` (default `dtype`, the activations'): every P2P message's buffer (a
        state of several tensors travels as one uint8 buffer: pipeline.runtime.boundary)."""
        self.plan = plan
        self.rank = plan.rank
        self.who = who or f"rank {plan.rank}"
        self.schedule = lower_comms(plan.schedule)
        self.actions = self.schedule.actions[self.rank]
        self.specs = {sp.stage: sp for sp in plan.stages}
        self.stages = stages
        self.transport, self.recorder, self.env, self.store = transport, recorder, env, store
        self.shape, self.dtype, self.device = boundary_shape, dtype, device
        self.wire_dtype = boundary_dtype or dtype
        self.pair, self.expert, self.grads = pair, expert, grads
        self.on_action = on_action
        # every send of the step in lowered order, per peer: the channel order the receiver expects
        self.send_order: dict[int, list[tuple[Kind, int, int]]] = defaultdict(list)
        self.send_peer: dict[tuple[Kind, int, int], int] = {}
        for a in self.actions:
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                self.send_order[a.peer].append((a.kind, a.stage, a.mb))
                self.send_peer[(a.kind, a.stage, a.mb)] = a.peer
        self._reset()

    def _reset(self) -> None:
        self.runs: dict[tuple[int, int], ChunkRun] = {}
        self.mail_f: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb) -> input from a local prev stage
        self.mail_b: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb) -> output-grad from a local next stage
        self.recvs: dict[tuple[Kind, int, int], Pending] = {}
        self.sends: list[Pending] = []
        self.ready: dict[tuple[Kind, int, int], torch.Tensor] = {}  # produced, not yet posted (channel order)
        self.posted: set[tuple[Kind, int, int]] = set()
        self.next_send = {peer: 0 for peer in self.send_order}
        self.hold_sends = False  # a serial F&B (--no-overlap) posts its sends after the pair
        self.deferred_posts: list[int] | None = None  # peers whose sends wait for the current span to close
        self.loss_sum = torch.zeros((), dtype=torch.float64 if self.dtype == torch.float64 else torch.float32,
                                    device=self.device)

    def _local(self, stage: int | None) -> bool:
        return stage is not None and self.specs[stage].rank == self.rank

    # -- comm ----------------------------------------------------------------------------------------------
    def _post_recvs(self, group) -> None:
        ops, labels = [], []
        for a in group:
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                if (a.kind, a.stage, a.mb) not in self.posted and (a.kind, a.stage, a.mb) not in self.ready:
                    raise PipelineError(f"{self.who}: {a.kind.value}/s{a.stage}/mb{a.mb} has nothing to send "
                                        "(schedule order broken)")
                continue
            ops.append((False, span_name(a.kind.value, a.stage, a.mb), a.peer,
                        torch.empty(self.shape, dtype=self.wire_dtype, device=self.device)))
            labels.append((a.kind.value, a.stage, a.mb))
        if ops:
            for (kind, stage, mb), p in zip(labels, self.transport.post(ops, labels)):
                self.recvs[(Kind(kind), stage, mb)] = p

    def _produced(self, kind: Kind, stage: int, mb: int, tensor: torch.Tensor) -> None:
        """A tensor to send exists: post it now, after any earlier send to the same peer that is not out yet."""
        key = (kind, stage, mb)
        peer = self.send_peer.get(key)
        if peer is None:
            raise PipelineError(f"{self.who}: produced {kind.value}/s{stage}/mb{mb} but the lowered schedule "
                                "has no send for it")
        self.ready[key] = tensor
        if self.deferred_posts is not None:
            self.deferred_posts.append(peer)  # posted when the producing action's span closes
        elif not self.hold_sends:
            self._flush_sends(peer)

    def _flush_sends(self, peer: int) -> None:
        """Post the ready sends to `peer` that are next in its channel order."""
        order, ops, labels = self.send_order[peer], [], []
        i = self.next_send[peer]
        while i < len(order) and order[i] in self.ready:
            k = order[i]
            ops.append((True, span_name(k[0].value, k[1], k[2]), peer, self.ready.pop(k)))
            labels.append((k[0].value, k[1], k[2]))
            self.posted.add(k)
            i += 1
        self.next_send[peer] = i
        if ops:
            self.sends.extend(self.transport.post(ops, labels))

    def _take_recv(self, kind: Kind, producer: int, mb: int, side: str | None = None) -> torch.Tensor:
        p = self.recvs.pop((kind, producer, mb), None)
        if p is None:
            raise PipelineError(f"{self.who}: needs {kind.value}/s{producer}/mb{mb} but never posted its "
                                "receive (the lowered schedule is inconsistent)")
        if side is not None and self.pair is not None:
            self.pair.wait(side, p)  # the other half computes while it is in flight
        return self.transport.wait(p)

    def _reap_sends(self, drain: bool = False) -> None:
        """Drop the sends that completed (all of them, waited, with `drain`). Sends whose completion no poll can
        see (unwatched gloo P2P) wait for the drain at the end of the step."""
        if drain:
            for p in self.sends:
                self.transport.wait(p)
            self.sends = []
            return
        self.sends = [p for p in self.sends if not (p.observable and self.transport.poll(p))]

    # -- halves ------------------------------------------------------------------------------------------
    def _forward_input(self, stage: int, mb: int, batch: Batch, side: str | None = None):
        spec = self.specs[stage]
        ids, labels = batch.microbatch(global_microbatch(self.plan, spec.pipeline, mb))
        if spec.has_embed:
            inp = ids.to(self.device, non_blocking=True)  # pinned on CUDA (RankRuntime.step): no host sync
        elif self._local(spec.prev):
            inp = self.mail_f.pop((stage, mb))
        else:
            inp = self._take_recv(Kind.RECV_F, spec.prev, mb, side)
        return inp, (labels.to(self.device, non_blocking=True) if spec.has_head else None)

    @contextlib.contextmanager
    def _span(self, kind: str | None, stage: int, mb: int):
        """The span of a whole F/B/I: opened once its input is here (the wait for it is a WAIT span, not F), and
        closed before the output it produced is posted (posting is communication: a gloo send's CPU time inside
        an F span would be counted as compute)."""
        if kind is None:
            yield
            return
        self.deferred_posts = []
        try:
            with self.recorder.range(kind, stage, mb, name=span_name(kind, stage, mb)):
                yield
        finally:
            posts, self.deferred_posts = self.deferred_posts, None
        if not self.hold_sends:  # a serial pair posts its sends after the pair
            for peer in posts:
                self._flush_sends(peer)

    def _forward(self, stage: int, mb: int, batch: Batch, side: str | None = None, span: str | None = None,
                 given=None) -> None:
        """The forward of (stage, mb); `side` "F" inside an overlapped pair (turn hand-over at segments, spans
        per piece), else one span `span` around it. `given`: its (input, labels), already waited for."""
        inp, labels = given if given is not None else self._forward_input(stage, mb, batch, side)
        with self._span(span, stage, mb):
            self._forward_compute(stage, mb, inp, labels, side)

    def _forward_compute(self, stage: int, mb: int, inp, labels, side: str | None) -> None:
        run = ChunkRun(stage, mb)
        self.runs[(stage, mb)] = run
        st = self.stages[stage]
        if st.wants_ids and not self.specs[stage].has_embed:
            ids, _ = self.batch.microbatch(global_microbatch(self.plan, self.specs[stage].pipeline, mb))
            run.ids = ids.to(self.device, non_blocking=True)  # the real ids, never derived from the state
        if self.expert is not None:
            self.expert.set_chunk(stage, mb)
        pair = self.pair if side else None
        if pair is not None:
            pair.resume(side, st.labels[0])
        for k, _ in enumerate(st.forward_steps(run, inp, labels, self.env)):
            if pair is not None and k + 1 < len(st.labels):
                pair.switch(side)
                pair.resume(side, st.labels[k + 1])
        spec = self.specs[stage]
        if spec.has_head:
            self.loss_sum += run.loss.to(self.loss_sum.dtype)
        elif self._local(spec.next):
            self.mail_f[(spec.next, mb)] = run.output
        else:
            self._produced(Kind.SEND_F, stage, mb, run.release_output())

    def _backward_input(self, stage: int, mb: int, side: str | None = None) -> torch.Tensor | None:
        """The output-grad of (stage, mb): none at the head, a local hand-off, or its receive (waited for)."""
        spec = self.specs[stage]
        if spec.has_head:
            return None
        if self._local(spec.next):
            return self.mail_b.pop((stage, mb))
        return self._take_recv(Kind.RECV_B, spec.next, mb, side)

    def _backward(self, stage: int, mb: int, *, split: bool, side: str | None = None, span: str | None = None,
                  given=None) -> None:
        """The input-grad chain of (stage, mb) with the Linears' weight-grads deferred, the input-grad handed
        on (send or local), then the weight-grads (full B) or their group flushed to the store (I). `given`:
        `(output-grad,)`, already waited for."""
        spec = self.specs[stage]
        run = self.runs.pop((stage, mb), None)
        if run is None:
            raise PipelineError(f"{self.who}: backward of s{stage}/mb{mb} before its forward")
        grad = given[0] if given is not None else self._backward_input(stage, mb, side)
        with self._span(span, stage, mb):
            self._backward_compute(spec, run, grad, split, side)

    def _backward_compute(self, spec, run, grad, split: bool, side: str | None) -> None:
        stage, mb = spec.stage, run.mb
        labels = self.stages[stage].labels[::-1]
        pair = self.pair if side else None
        if pair is not None:
            pair.resume(side, labels[0])
        # defer the Linears' weight-grads past the input-grad when something waits for it: a later W (I), or a
        # peer rank (its send goes out before the W work); otherwise they run inline, without closures
        self.store.enabled = split or (side is not None and not spec.has_embed and not self._local(spec.prev))
        try:
            for k, _ in enumerate(self.stages[stage].backward_steps(run, grad, self.env)):
                if pair is not None and k + 1 < len(labels):
                    pair.switch(side)
                    pair.resume(side, labels[k + 1])
        finally:
            self.store.enabled = False
        if not spec.has_embed:
            if self._local(spec.prev):
                self.mail_b[(spec.prev, mb)] = run.input_grad
            else:
                self._produced(Kind.SEND_B, stage, mb, run.input_grad)
        run.output = None
        if split:
            self.store.flush((stage, mb))
            return
        if pair is not None:
            return  # the input-grad is out: the W work fills the pair's waits, what is left runs at its end
        self.store.run_current()

    # -- actions -------------------------------------------------------------------------------------------
    def _compute(self, a, batch: Batch) -> None:
        rec, kind = self.recorder, a.kind
        if kind is Kind.F:
            self._forward(a.stage, a.mb, batch, span="F")
        elif kind in (Kind.B, Kind.I):
            self._backward(a.stage, a.mb, split=kind is Kind.I, span=kind.value)
        elif kind is Kind.W:
            with rec.range("W", a.stage, a.mb, name=span_name("W", a.stage, a.mb)):
                label = self.store.pop()
            if label != (a.stage, a.mb):
                raise PipelineError(f"{self.who}: W/s{a.stage}/mb{a.mb} popped the weight-grads of "
                                    f"s{label[0]}/mb{label[1]}; the W queue must be FIFO in I order")
        elif kind is Kind.FB:
            self._pair(a, batch)
        else:
            raise PipelineError(f"{self.who}: unknown action {a}")

    def _pair(self, a, batch: Batch) -> None:
        """One F&B pair. Run in turn, its span starts once its first half's input is here (that wait is a WAIT
        span before it) and the other half waits for its own input when it comes to it; overlapped (exchanges
        inside), the halves start together and either computes while the other's input is in flight. Serial
        (--no-overlap): both inputs first, F, then B, and the pair's sends after it."""
        name = span_name("FB", a.stage, a.mb, (a.b_stage, a.b_mb))

        def fb():
            return self.recorder.range("FB", a.stage, a.mb, partner=(a.b_stage, a.b_mb), name=name)

        def f_half(given=None):
            return self._forward(a.stage, a.mb, batch, span="F", given=given)

        def b_half(given=None):
            return self._backward(a.b_stage, a.b_mb, split=False, span="B", given=given)

        if self.pair is None:
            f_in, b_in = self._forward_input(a.stage, a.mb, batch), (self._backward_input(a.b_stage, a.b_mb),)
            self.hold_sends = True
            try:
                with fb():
                    f_half(f_in)
                    b_half(b_in)
            finally:
                self.hold_sends = False
            for peer in self.send_order:
                self._flush_sends(peer)
        elif self.stages[a.stage].exchanges or self.stages[a.b_stage].exchanges:
            with fb():  # overlapped: even the forward's input wait lets the backward half compute
                first = "F" if self.pair.dynamic or not self._b_first(a) else "B"  # fixed turns: start ready
                self.pair.run(lambda: self._forward(a.stage, a.mb, batch, side="F"),
                              lambda: self._backward(a.b_stage, a.b_mb, split=False, side="B"),
                              f_chunk=(a.stage, a.mb), b_chunk=(a.b_stage, a.b_mb), first=first)
        elif self._b_first(a):
            b_in = (self._backward_input(a.b_stage, a.b_mb),)
            with fb():
                b_half(b_in)
                f_half()
        else:
            f_in = self._forward_input(a.stage, a.mb, batch)
            with fb():
                f_half(f_in)
                b_half()

    def _b_first(self, a) -> bool:
        """A pair without communication inside its halves runs them one after the other on this thread (there is
        nothing to interleave), starting with the one whose input is here: B first only when F's receive is still
        in flight and B's is not."""
        f_spec, b_spec = self.specs[a.stage], self.specs[a.b_stage]
        f_recv = None if f_spec.prev is None or self._local(f_spec.prev) else \
            self.recvs.get((Kind.RECV_F, f_spec.prev, a.mb))
        if f_recv is None or self.transport.poll(f_recv):
            return False
        b_recv = None if b_spec.next is None or self._local(b_spec.next) else \
            self.recvs.get((Kind.RECV_B, b_spec.next, a.b_mb))
        return b_recv is None or self.transport.poll(b_recv)

    def run_step(self, batch: Batch) -> torch.Tensor:
        """Execute every action of this rank for one step; returns this rank's summed loss contributions.
        Gradient reductions posted during the step are finished by the caller (`GradReducer.finish`)."""
        self._reset()
        self.batch = batch
        acts, i = self.actions, 0
        while i < len(acts):
            a = acts[i]
            if self.on_action is not None:
                self.on_action(i, a)
            if a.kind in COMM_KINDS:
                j = i
                while j < len(acts) and acts[j].kind in COMM_KINDS:
                    j += 1
                self._post_recvs(acts[i:j])
                i = j
                continue
            self._compute(a, batch)
            if self.grads is not None:
                self.grads.action_done(i)
            if self.sends:
                self._reap_sends()
            i += 1
        self._reap_sends(drain=True)
        self._check_clean()
        return self.loss_sum

    def _check_clean(self) -> None:
        leftovers = {"receives": list(self.recvs), "hand-offs": list(self.mail_f) + list(self.mail_b),
                     "unsent": list(self.ready), "chunks without backward": list(self.runs)}
        bad = {k: v for k, v in leftovers.items() if v}
        if bad or len(self.store):
            raise PipelineError(f"{self.who}: step ended with leftovers {bad}, "
                                f"{len(self.store)} W groups; the schedule is incomplete")
