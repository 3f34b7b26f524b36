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
import time
from dataclasses import dataclass, field

import torch


class PipelineError(RuntimeError):
    """A distributed failure with a one-line, user-facing message (rank, op, peer, cause)."""


def describe(err: BaseException) -> str:
    text = str(err)
    if "Connection closed by peer" in text or "Connection reset" in text or "Broken pipe" in text:
        return "the peer closed its connection (it probably died)"
    if "Timed out" in text or "timed out" in text or "Timeout" in text:
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
    done_ns: list = field(default_factory=list)  # completion time (perf_counter_ns), set by the future's callback


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


def stamp_completion(handle: Handle) -> None:
    """Ask the backend to note the completion time (collectives; gloo P2P works have no future)."""
    try:
        fut = handle.work.get_future()
    except (RuntimeError, AttributeError):
        return
    stamp = handle.done_ns
    fut.then(lambda _f: stamp.append(time.perf_counter_ns()))


class Comms:
    """Waits and polls for one rank, with its deadline, recorder and error messages."""

    def __init__(self, rank: int, recorder, timeout_s: float):
        self.rank = rank
        self.recorder = recorder
        self.timeout_s = float(timeout_s)

    def post(self, fn, *args, name: str, kind: str, stage: int | None, mb: int | None, peer, **kwargs) -> Handle:
        """Post a collective `fn(*args, async_op=True, **kwargs)`; its output is the caller's business."""
        token = self.recorder.begin_async(kind, stage, mb, peer if isinstance(peer, int) else None, f"{name}~comm")
        try:
            work = fn(*args, async_op=True, **kwargs)
        except Exception as err:  # noqa: BLE001 - backend errors have no common type
            raise PipelineError(f"rank {self.rank}: posting {name} ({peer}) failed: {describe(err)}") from None
        h = Handle(False, name, peer, stage, mb, work=work, token=token)
        stamp_completion(h)
        return h

    def poll(self, h: Handle) -> bool:
        """Non-blocking: has `h` completed? (then its comm span is closed). Errors surface as PipelineError."""
        if h.done:
            return True
        try:
            finished = h.work.is_completed()
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
        blocked = not h.work.is_completed()
        wtok = self.recorder.begin("WAIT", h.stage, h.mb, name=f"WAIT/{h.name}", nvtx=False) if blocked else None
        try:
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

    @staticmethod
    def _with(h: Handle) -> str:
        if isinstance(h.peer, int):
            return f"{'to' if h.is_send else 'from'} rank {h.peer}"
        return f"in the {h.peer}"
