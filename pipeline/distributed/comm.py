"""Asynchronous communication handles of one rank: post, poll, wait with a deadline, and the spans that make
exposed communication a measurement (traces.md §5).

Every P2P op, all-to-all and gradient all-reduce of the runtime is posted with `async_op` and becomes a `Handle`.
Posting returns at once (on NCCL once the communicator is connected: the first op to a peer on it connects,
docs/communication.md); the compute thread waits only right before the result is used (`Comms.wait`).
Recording: a `~comm` span from post to completion; completion is the time the op's future fired (collectives on
gloo and NCCL report it through `Work.get_future()`), else the first time a poll or wait saw it done. When the
compute thread has to block, a `WAIT` span on the compute stream covers exactly the blocked time and names what
it waited for (`WAIT/<op name>`), so exposed = WAIT time and hidden = communication time outside WAIT spans.

CUDA (NCCL, `stream_ordered`; every CUDA call through the device layer, pipeline.device, so that the emulated
device runs this branch on CPU): ops are posted from a communication stream that first waits for the compute
stream, so a comm span starts with an event on that stream when the data is ready; its end is an event recorded
on an end stream after `Work.wait()` orders that stream behind NCCL's, i.e. when the transfer finished.
Waiting for a result orders the compute stream behind the work (`Work.wait()` without a timeout: the host keeps
queuing kernels) and the `WAIT` span is a pair of events on the compute stream, i.e. how long that stream
stalled. Only a result read by the host makes the host wait, by polling: `wait(host=True)`, or `host_read`, whose
copy is queued behind the op alone (the expert counts).

End streams (`_EndStreams`): each in-flight op gets a stream of its own for its end event or its host copy, and a
stream is handed out again only once what it last waited for has completed. A shared stream would queue a later
op's end event, or the expert counts' copy, behind an earlier op that is still in flight, e.g. a receive posted
early whose sender needs this rank's next output: the counts' reader would then wait for that receive, which
serialises ranks or hangs. The streams are created outside torch's stream pool where the CUDA runtime allows it
(the pool is shared with ProcessGroupNCCL's own streams; a pool stream can be a channel's NCCL stream), and they
are *non-blocking*: a blocking stream and the legacy default stream, where the model's kernels run, order each
other both ways, so an end stream parked on an early-posted receive would hold every later kernel of the rank
(1F1B on two ranks then waits in a circle at step 1: docs/cuda_program.md). The tensors an op reads or fills
(the all-to-all's input included) stay referenced by its Handle until its end event completed, so the caching
allocator never hands their memory to another kernel while NCCL still uses it (`Work.wait()` drops
ProcessGroupNCCL's own reference).

Deadlines: gloo works take `Work.wait(timeout)`; NCCL works are polled (`is_completed`, which queries an event)
with a sleeping back-off, never waited with a timeout (that busy-waits the host); a stream-ordered wait has the
process group's own timeout (NCCL's watchdog). Failures become a `PipelineError` naming the rank, the op (trace
name, e.g. RECV_F/s1/mb3 or A2A_DISPATCH/s2/mb0/L3) and the peer or group: a timeout, or a peer that closed its
connection (it died).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from pipeline.distributed.collective import check_devices, tensor_args, wait_work
from pipeline.distributed import op_ledger
from pipeline.device.poll import poll
from pipeline.distributed.errors import PipelineError, describe

__all__ = ["Comms", "Handle", "P2PWaiter", "wait_work"]


@dataclass
class Handle:
    """One posted communication op."""

    is_send: bool
    name: str  # trace name without the stream suffix, e.g. SEND_F/s3/mb7, A2A_DISPATCH/s3/mb7/L13
    peer: int | str  # the other rank (global), or the group ("EP group", "dp group") of a collective
    stage: int | None = None  # the (stage, micro-batch) the op belongs to, for its spans
    mb: int | None = None
    tensor: torch.Tensor | None = None  # the device tensor sent, or the buffer the op delivers into
    wire: object = None  # what the backend actually reads/writes (host copy when staged; a collective's tensors)
    work: object | None = None
    token: object = None  # recorder handle of the ~comm span
    done: bool = False
    done_ns: list = field(default_factory=list)  # completion time (perf_counter_ns), when the backend reported it
    event: threading.Event | None = None  # set once the work completed (or failed): future callback or waiter
    waited_elsewhere: bool = False  # a P2PWaiter thread owns the work's wait(); wait on `event` instead
    error: BaseException | None = None  # the waiter thread's failure
    p2p_polls: bool = True  # False: a P2P work whose completion only a wait sees (unwatched gloo)

    @property
    def observable(self) -> bool:
        """Can polling see this op complete? Not an unwatched gloo P2P work: gloo reports those complete only
        from inside `wait()`, so polling them is wasted work."""
        return self.done or self.event is not None or self.p2p_polls


class P2PWaiter:
    """Completion of works without a future (gloo P2P): gloo reports such a work complete only from inside
    `wait()`, so a pool of daemon threads waits for each one and signals its handle when it returns; the compute
    thread then waits on the handle's event instead of the work."""

    def __init__(self, signal, threads: int = 16):
        from concurrent.futures import ThreadPoolExecutor

        self._signal = signal
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="p2p-wait")

    def add(self, h: Handle, limit: float) -> None:
        h.waited_elsewhere = True
        self._pool.submit(self._wait, h, limit)

    def _wait(self, h: Handle, limit: float) -> None:
        try:
            if not wait_work(h.work, limit):
                h.error = TimeoutError("Timed out")
        except BaseException as err:  # noqa: BLE001 - handed to the compute thread's wait
            h.error = err
        finally:
            self._signal(h)

    def close(self) -> None:
        """Let the idle waiter threads exit (a process that runs many runtimes, e.g. the tests' rank pool)."""
        self._pool.shutdown(wait=False)


class _EndStreams:
    """Streams for one in-flight op each (see the module docstring): `acquire` hands out a stream whose last op
    has completed, or a new one; `release(stream, event, keep)` returns it with the event that marks its op's end
    and the tensors to keep alive until then. `new_stream` makes a stream (a test passes a fake)."""

    def __init__(self, new_stream):
        self._new = new_stream
        self._idle: list = []
        self._busy: list[tuple[object, object, tuple]] = []  # (stream, end event, tensors kept alive)
        self.created = 0

    def acquire(self):
        self.reap()
        if self._idle:
            return self._idle.pop()
        self.created += 1
        return self._new()

    def release(self, stream, event, keep: tuple = ()) -> None:
        self._busy.append((stream, event, keep))

    def reap(self) -> None:
        """Streams whose op completed become idle; the tensors they kept are let go."""
        busy = []
        for entry in self._busy:
            if entry[1].query():
                self._idle.append(entry[0])
            else:
                busy.append(entry)
        self._busy = busy

    @property
    def in_flight(self) -> int:
        return len(self._busy)


class Comms:
    """Waits and polls for one rank, with its deadline, recorder and error messages."""

    def __init__(self, rank: int, recorder, timeout_s: float, watch_p2p: bool = True,
                 stream_ordered: bool = False, dev=None, names=None):
        """`watch_p2p`: make gloo P2P completion observable with waiter threads (needed for comm spans and for an
        F&B pair that hands the turn over while a receive is in flight); without it gloo P2P works complete only
        when their consumer waits for them, as in torch's own schedules, and cost no extra thread wake-ups.
        `stream_ordered`: the works are NCCL's, or the emulated device's, on `dev` (pipeline.device.layer.Device;
        see the module docstring). `names(group) -> str`: a process group's name (programs name communicators)."""
        self.rank = rank
        self.recorder = recorder
        self.timeout_s = float(timeout_s)
        self.stream_ordered = stream_ordered
        self._cv = threading.Condition()  # notified whenever any tracked op completes
        self._p2p_futures: bool | None = None  # do this backend's P2P works have futures? (learned once)
        self.stream = None  # CUDA: the stream ops are posted from (it waits for the compute stream first)
        self.end_streams: _EndStreams | None = None  # CUDA: one stream per in-flight op (module docstring)
        self._batches: dict[str | None, int] = {}  # group name -> batches posted on it
        self._batch_lock = threading.Lock()
        self.strict = None  # pipeline.distributed.strict_transport.StrictTransport: notes collectives, reports hangs
        self.dev = dev
        self.names = names or (lambda g: "world" if g is None else f"group{id(g):x}")
        if stream_ordered and dev is not None:
            self.stream = dev.new_stream("comm")
            self.end_streams = _EndStreams(lambda: dev.new_stream("end"))
        # host-side works (gloo): P2P completion is observable only through a waiter thread
        self.waiter = P2PWaiter(self._signal) if watch_p2p and self.stream is None else None

    # -- posting -------------------------------------------------------------------------------------------
    def launch(self, post, spans: list[tuple], group: str | None = None, pg=None, kind: str = "coll",
               ops: list[tuple] | None = None, tensors: list | None = None):
        """Call `post()` (which issues one batch of async ops on the process group named `group` and returns
        their works) and open one comm span per (kind, stage, mb, peer, name) in `spans`, carrying the group and
        the batch's number on it (per group, in posting order: traces.analysis.comm_replay); `pg` (the process group)
        and
        `kind` ("coll" or "p2p") go to the op ledger for Flight Recorder (op_ledger): on CPU once the ops are in
        flight (posting is the compute thread's work), on CUDA from the communication stream, which first waits
        for the compute stream (the data is ready). `ops` ((kind, peer, name) each) and `tensors` describe the
        batch to the device layer. Returns (works, tokens)."""
        rec = self.recorder
        with self._batch_lock:  # both halves of an F&B pair post (one at a time; the lock keeps it exact)
            batch = self._batches.get(group, 0)
            self._batches[group] = batch + 1
            if pg is not None:
                op_ledger.note(pg, kind, [span[-1].removesuffix("~comm") for span in spans], label=group)
        dev = self.dev
        if self.stream is None:
            works = post() if dev is None else self._post(post, group, pg, ops, tensors)
            return works, [rec.begin_async(*span, group=group, batch=batch) for span in spans]
        self.stream.wait_stream(dev.current_stream())
        with dev.use(self.stream):
            tokens = [rec.begin_async(*span, group=group, batch=batch, cuda_stream=self.stream) for span in spans]
            return self._post(post, group, pg, ops, tensors), tokens

    def _post(self, post, group: str | None, pg, ops, tensors):
        import torch.distributed as dist

        members = dist.get_process_group_ranks(pg) if pg is not None else list(range(dist.get_world_size()))
        return self.dev.post(post, comm=group or self.names(pg), members=members, ops=ops or [],
                             tensors=tensors or [])

    def _signal(self, h: Handle) -> None:
        """An op completed (called from a backend or waiter thread): stamp it, wake whoever waits for any op."""
        h.done_ns.append(time.perf_counter_ns())
        h.event.set()
        with self._cv:
            self._cv.notify_all()

    def track(self, h: Handle, p2p: bool = False) -> None:
        """Make a posted op's completion observable and timed: on CUDA an end event behind the work on a
        completion stream (its span closes there); else its future's callback, or a waiter thread (gloo P2P
        works have no future)."""
        if self.end_streams is not None:
            dev = self.dev
            done = self.end_streams.acquire()
            dev.wait_work(h.work, done)  # orders only `done`, which nothing else uses meanwhile, behind NCCL's stream
            with dev.use(done):
                self.recorder.end_async(h.token, cuda_stream=done)
            end = dev.event()
            end.record(done)
            self.end_streams.release(done, end, (h.tensor, h.wire))
            h.token = None
            return
        if p2p and self._p2p_futures is False and self.waiter is None:
            h.p2p_polls = False  # gloo P2P, unwatched: completion is seen only by waiting for it
            return
        h.event = threading.Event()
        fut = None
        if not (p2p and self._p2p_futures is False):
            try:
                fut = h.work.get_future()
            except (RuntimeError, AttributeError):
                pass
            if p2p:
                self._p2p_futures = fut is not None
        if fut is not None:
            fut.then(lambda _f, h=h: self._signal(h))
        elif self.waiter is not None:
            self.waiter.add(h, self.timeout_s)
        else:
            h.event = None  # completion seen only by waiting for it
            h.p2p_polls = not p2p

    def completed(self, h: Handle) -> bool:
        """Has `h` completed? Non-blocking; False until its result is usable."""
        if h.done:
            return True
        if h.event is not None:
            return h.event.is_set()
        return self.dev.work_done(h.work) if self.stream is not None else h.work.is_completed()

    def wait_any(self, handles: list[Handle], limit_s: float) -> bool:
        """Block until one of `handles` completes (True) or `limit_s` passes (False)."""
        if any(h.event is None for h in handles):  # no completion signal (NCCL, unwatched gloo P2P): poll
            return poll(lambda: any(self.completed(h) for h in handles), limit_s)
        deadline = time.monotonic() + limit_s
        with self._cv:
            while not any(self.completed(h) for h in handles):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def post(self, fn, *args, name: str, kind: str, stage: int | None, mb: int | None, peer, group_name: str,
             **kwargs) -> Handle:
        """Post a collective `fn(*args, async_op=True, **kwargs)` (its tensors checked against the group's backend
        first) on the group named `group_name`; its output is the caller's business. Every tensor in `args` stays
        referenced by the Handle until the op's end (an input made for the call, e.g. `x.contiguous()`, would
        otherwise go back to the allocator while NCCL still reads it)."""
        check_devices(args, kwargs.get("group"), name, self.rank)
        keep = list(tensor_args(args))
        if self.dev is not None:
            view = self.dev.backend_view
            args = tuple([view(t) if torch.is_tensor(t) else t for t in a] if isinstance(a, (list, tuple))
                         else view(a) if torch.is_tensor(a) else a for a in args)
        if self.strict is not None:
            import torch.distributed as dist

            self.strict.note_collective(group_name, dist.get_process_group_ranks(kwargs.get("group")), fn.__name__,
                                        name, args)
        try:
            views = list(tensor_args(args))
            work, (token,) = self.launch(lambda: fn(*args, async_op=True, **kwargs),
                                         [(kind, stage, mb, peer if isinstance(peer, int) else None, f"{name}~comm")],
                                         group=group_name, pg=kwargs.get("group"),
                                         ops=[(fn.__name__, None, name)], tensors=views)
        except Exception as err:  # noqa: BLE001 - backend errors have no common type
            raise PipelineError(f"rank {self.rank}: posting {name} ({peer}) failed: {describe(err)}") from None
        h = Handle(False, name, peer, stage, mb, work=work, token=token, wire=keep)
        self.track(h)
        return h

    def host_read(self, h: Handle, tensors: list[torch.Tensor]):
        """A reader of `tensors` (which `h`'s op fills or reads) as one host list: call it after waiting for `h`.
        CUDA: the device-to-host copy is queued now on a side stream ordered behind `h`'s work alone, and the
        reader polls its event (with the deadline), so the host never waits for later kernels of the compute
        stream; elsewhere the reader reads the tensors."""
        if self.end_streams is None:
            return lambda: torch.cat(tensors).tolist()
        side = self.end_streams.acquire()  # idle: the copy waits for `h` and for nothing else
        self.dev.wait_work(h.work, side)
        done, host = self.dev.read_later(tensors, side)
        self.end_streams.release(side, done, (*tensors, host))

        def read() -> list:
            if not self.dev.host_wait_events([done], self.timeout_s):
                raise self.timeout_error(h)
            return host().tolist()

        return read

    def poll(self, h: Handle) -> bool:
        """Non-blocking: has `h` completed? (then its comm span is closed). Errors surface as PipelineError."""
        if h.done:
            return True
        try:
            finished = self.completed(h)
        except Exception as err:  # noqa: BLE001
            raise PipelineError(f"rank {self.rank}: {h.name} {self._with(h)} failed: {describe(err)}") from None
        if finished:
            self.wait(h)
        return finished

    def wait(self, h: Handle, deadline_s: float | None = None, host: bool = False) -> None:
        """Make `h`'s result usable, with the deadline. CPU: block until it completes, a `WAIT` span covering the
        blocked time, if any. CUDA: order the current stream behind it (the `WAIT` span is that stream's stall);
        `host=True` when the host reads the result next: poll until it completed first."""
        if h.done:
            return
        limit = self.timeout_s if deadline_s is None else deadline_s
        started = time.monotonic()
        blocked = self.stream_ordered or not self.completed(h)
        wtok = self.recorder.begin("WAIT", h.stage, h.mb, name=f"WAIT/{h.name}") if blocked else None
        try:
            if h.waited_elsewhere:  # a waiter thread owns the work's wait
                ok = h.event.wait(limit)
                if ok and h.error is not None:
                    raise h.error
            elif self.stream_ordered and not host:  # the process group's timeout bounds it (NCCL's watchdog)
                self.dev.wait_work(h.work) if self.stream is not None else h.work.wait()
                ok = True
            elif self.stream is not None:
                ok = self.dev.host_wait_work(h.work, limit)
                if ok:  # the host reads next: what the stream queued before must be done
                    ev = self.dev.event()
                    ev.record()
                    ok = poll(ev.query, max(0.0, limit - (time.monotonic() - started)))
            else:
                ok = wait_work(h.work, limit, polled=self.stream_ordered)
        except Exception as err:  # noqa: BLE001
            cause = describe(err)
            if isinstance(err, PipelineError):  # the strict transport's batch error: keep its cause only
                cause = str(err).split(" failed: ", 1)[-1]
            if cause == "the backend timed out":
                raise self.timeout_error(h, limit) from None
            # a peer that died of its own timeout closes its connections: the heads say where the job hung
            hint = f"; {self.strict.hang_report()}" if self.strict is not None else ""
            raise PipelineError(f"rank {self.rank}: {h.name} {self._with(h)} failed after "
                                f"{time.monotonic() - started:.1f} s: {cause}{hint}") from None
        if not ok:
            raise self.timeout_error(h, limit)
        if wtok is not None:
            self.recorder.end(wtok)
        h.done = True
        if h.token is not None:
            self.recorder.end_async(h.token, h.done_ns[0] if h.done_ns else None)
            h.token = None

    def timeout_error(self, h: Handle, limit: float | None = None) -> PipelineError:
        """The one-line error of a wait that ran out; under the strict transport with every rank's queue heads."""
        hint = f"; {self.strict.hang_report()}" if self.strict is not None else ""
        return PipelineError(f"rank {self.rank}: timed out after {self.timeout_s if limit is None else limit:g} s "
                             f"waiting for {h.name} {self._with(h)}{hint}")

    @staticmethod
    def _with(h: Handle) -> str:
        if isinstance(h.peer, int):
            return f"{'to' if h.is_send else 'from'} rank {h.peer}"
        return f"in the {h.peer}"  # a collective's group, e.g. "EP group (ranks 0, 1)"
