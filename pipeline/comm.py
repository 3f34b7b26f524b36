"""Asynchronous communication handles of one rank: post, poll, wait with a deadline, and the spans that make
exposed communication a measurement (traces.md §5).

Every P2P op, all-to-all and gradient all-reduce of the runtime is posted with `async_op` and becomes a `Handle`.
Nothing blocks at post time; the compute thread waits only right before the result is used (`Comms.wait`).
Recording: a `~comm` span from post to completion; completion is the time the op's future fired (collectives on
gloo and NCCL report it through `Work.get_future()`), else the first time a poll or wait saw it done. When the
compute thread has to block, a `WAIT` span on the compute stream covers exactly the blocked time and names what
it waited for (`WAIT/<op name>`), so exposed = WAIT time and hidden = communication time outside WAIT spans.

Deadlines: `Work.wait(timeout)` where the backend supports it (gloo does), otherwise a poll of `is_completed()`
until the deadline. Failures become a `PipelineError` naming the rank, the op (trace name, e.g. RECV_F/s1/mb3 or
A2A_DISPATCH/s2/mb0/L3) and the peer or group: a timeout, or a peer that closed its connection (it died).
"""
from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass, field

import torch


class PipelineError(RuntimeError):
    """A distributed failure with a one-line, user-facing message (rank, op, peer, cause)."""


def describe(err: BaseException) -> str:
    text = str(err)
    if "Connection closed by peer" in text or "Connection reset" in text or "Broken pipe" in text:
        return "the peer closed its connection (it probably died)"
    if "timed out" in text.lower() or "timeout" in text.lower():
        return "the backend timed out"
    return text.splitlines()[0][:200] if text else type(err).__name__


@dataclass
class Handle:
    """One posted communication op."""

    is_send: bool
    name: str  # trace name without the stream suffix, e.g. SEND_F/s3/mb7, A2A_DISPATCH/s3/mb7/L13
    peer: int | str  # the other rank, or the group ("EP group", "dp group") of a collective
    stage: int | None = None  # the (stage, micro-batch) the op belongs to, for its spans
    mb: int | None = None
    tensor: torch.Tensor | None = None  # the device tensor sent, or the buffer the op delivers into
    wire: torch.Tensor | None = None  # what the backend actually reads/writes (host copy when staged)
    work: object | None = None
    token: object = None  # recorder handle of the ~comm span
    done: bool = False
    done_ns: list = field(default_factory=list)  # completion time (perf_counter_ns), when the backend reported it
    event: threading.Event | None = None  # set once the work completed (or failed): future callback or waiter
    waited_elsewhere: bool = False  # a P2PWaiter thread owns the work's wait(); wait on `event` instead
    error: BaseException | None = None  # the waiter thread's failure


def wait_work(work, limit: float) -> bool:
    """Block until `work` completes or `limit` seconds pass; False on timeout."""
    try:
        return work.wait(datetime.timedelta(seconds=limit)) is not False
    except (TypeError, NotImplementedError):
        pass  # backend without a timed wait: poll
    deadline = time.monotonic() + limit
    pause = 1e-5
    while not work.is_completed():
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
    work.wait()
    return True


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


class Comms:
    """Waits and polls for one rank, with its deadline, recorder and error messages."""

    def __init__(self, rank: int, recorder, timeout_s: float, watch_p2p: bool = True):
        """`watch_p2p`: make gloo P2P completion observable with waiter threads (needed for comm spans and for an
        F&B pair that hands the turn over while a receive is in flight); without it gloo P2P works complete only
        when their consumer waits for them, as in torch's own schedules, and cost no extra thread wake-ups."""
        self.rank = rank
        self.recorder = recorder
        self.timeout_s = float(timeout_s)
        self._cv = threading.Condition()  # notified whenever any tracked op completes
        self.waiter = P2PWaiter(self._signal) if watch_p2p and not recorder.cuda else None
        self._p2p_futures: bool | None = None  # do this backend's P2P works have futures? (learned once)

    def _signal(self, h: Handle) -> None:
        """An op completed (called from a backend or waiter thread): stamp it, wake whoever waits for any op."""
        h.done_ns.append(time.perf_counter_ns())
        h.event.set()
        with self._cv:
            self._cv.notify_all()

    def track(self, h: Handle, p2p: bool = False) -> None:
        """Make a posted op's completion observable and timed: its future's callback, or a waiter thread (gloo
        P2P works have no future)."""
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

    @staticmethod
    def completed(h: Handle) -> bool:
        """Has `h` completed? Non-blocking; False until its result is usable."""
        if h.done:
            return True
        return h.event.is_set() if h.event is not None else h.work.is_completed()

    def wait_any(self, handles: list[Handle], limit_s: float) -> bool:
        """Block until one of `handles` completes (True) or `limit_s` passes (False)."""
        deadline = time.monotonic() + limit_s
        with self._cv:
            while not any(self.completed(h) for h in handles):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def post(self, fn, *args, name: str, kind: str, stage: int | None, mb: int | None, peer, **kwargs) -> Handle:
        """Post a collective `fn(*args, async_op=True, **kwargs)`; its output is the caller's business."""
        try:
            work = fn(*args, async_op=True, **kwargs)
        except Exception as err:  # noqa: BLE001 - backend errors have no common type
            raise PipelineError(f"rank {self.rank}: posting {name} ({peer}) failed: {describe(err)}") from None
        # the span starts once the op is in flight: posting it is the compute thread's work
        token = self.recorder.begin_async(kind, stage, mb, peer if isinstance(peer, int) else None, f"{name}~comm")
        h = Handle(False, name, peer, stage, mb, work=work, token=token)
        self.track(h)
        return h

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

    def wait(self, h: Handle, deadline_s: float | None = None) -> None:
        """Block until `h` completes (at most the timeout). A `WAIT` span covers the blocked time, if any."""
        if h.done:
            return
        limit = self.timeout_s if deadline_s is None else deadline_s
        started = time.monotonic()
        blocked = not self.completed(h)
        wtok = self.recorder.begin("WAIT", h.stage, h.mb, name=f"WAIT/{h.name}", nvtx=False) if blocked else None
        try:
            if h.waited_elsewhere:  # a waiter thread owns the work's wait
                ok = h.event.wait(limit)
                if ok and h.error is not None:
                    raise h.error
            else:
                ok = wait_work(h.work, limit)
        except Exception as err:  # noqa: BLE001
            cause = describe(err)
            if cause == "the backend timed out":
                raise PipelineError(f"rank {self.rank}: timed out after {limit:g} s waiting for {h.name} "
                                    f"{self._with(h)}") from None
            raise PipelineError(f"rank {self.rank}: {h.name} {self._with(h)} failed after "
                                f"{time.monotonic() - started:.1f} s: {cause}") from None
        if not ok:
            raise PipelineError(f"rank {self.rank}: timed out after {limit:g} s waiting for {h.name} {self._with(h)}")
        if wtok is not None:
            self.recorder.end(wtok, pop=False)
        h.done = True
        self.recorder.end_async(h.token, h.done_ns[0] if h.done_ns else None)

    def timeout_error(self, h: Handle) -> PipelineError:
        return PipelineError(f"rank {self.rank}: timed out after {self.timeout_s:g} s waiting for {h.name} "
                             f"{self._with(h)}")

    @staticmethod
    def _with(h: Handle) -> str:
        if isinstance(h.peer, int):
            return f"{'to' if h.is_send else 'from'} rank {h.peer}"
        return f"in the {h.peer}"  # a collective's group, e.g. "EP group (ranks 0, 1)"
