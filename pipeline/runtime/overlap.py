"""The overlapped F&B pair: DualPipe's chunk interleaving of one micro-batch's forward with another's backward.

The forward half runs on the calling thread, the backward half on a helper thread (torchtitan's design for
DualPipeV: a second Python thread, one compute turn handed back and forth). Exactly one half computes at a time;
the turn moves at *switch points*:
* right after a half posts an all-to-all (pipeline.distributed.expert): its communication then flies while the other
half computes, and the half waits for it only when the turn comes back;
* at every segment boundary (a Transformer block, a recompute block, the embedding or the head), so the halves
  interleave block by block: forward attention / dispatch / MLP / combine of one micro-batch against backward
  combine / MLP / dispatch / attention of the other.
When a half comes back to an op that has not completed yet and the other half can compute (it is not itself
parked on an unfinished op), the turn goes to the other half again instead of blocking (`wait`); when neither
can (the other half parked, or already finished), the rank runs the backward half's deferred weight-gradient
work, one closure at a time (`B/.../L1.wfill` spans), and blocks only when there is none left, until either
half's op completes. The backward half leaves its weight-gradient work behind once its input-grad is out (DualPipe
defers W precisely to fill such gaps): it fills the forward half's waits, and whatever is left runs when both
halves are done, before the pair ends. That makes the
interleaving depend on timing, which collectives allow only because each half's all-to-alls use their own EP
process group (forward and backward exchanges), each issued in program order on every rank of the group. On
CUDA the host does not block on communication (a wait is a stream dependency), so turns there follow the
program only. When one half has finished, the other runs to its end.

Each stretch of compute between two switch points is one trace span named after where it starts
(`F/s3/mb7/L12.block`, `B/s4/mb2/L13.experts`, ...), so the F and B of a pair are drawn where and when they ran.
A failure in either half (a timeout, a dead peer) stops the other at its next switch point and the first error
is raised on the calling thread.

On CUDA both threads issue kernels to the compute stream (autograd runs the backward's kernels on the streams
of their forward); NCCL work runs on its own stream, so a posted all-to-all overlaps the other half's kernels.
"""
from __future__ import annotations

import queue
import threading
import time

import torch

from traces.trace import span_name


class HalfAborted(RuntimeError):
    """Raised at a switch point of one half when the other half failed."""


class PairRunner:
    def __init__(self, recorder, device: torch.device, comms, filler=None, dev=None):
        """`dev`: the device layer (pipeline.device) when waits are stream-ordered (CUDA, emulated CUDA): the turns
        then follow the program only."""
        self.recorder = recorder
        self.device = device
        self.dev = dev
        self.comms = comms
        self.filler = filler  # -> one deferred weight-grad closure of the running backward half, or None
        self._fills = 0
        self.dynamic = dev is None  # hand the turn over while an op is in flight (host-blocking waits)
        self._waiting: dict[str, object] = {"F": None, "B": None}  # side -> the op it is parked on
        self._cv = threading.Condition()
        self.active = False
        self._turn = "F"
        self._done = {"F": True, "B": True}
        self._error: BaseException | None = None
        self._open: dict[str, tuple | None] = {"F": None, "B": None}
        self._names: dict[str, str] = {}  # side -> span name prefix of the half, e.g. F/s3/mb7
        self._meta: dict[str, tuple] = {}  # side -> (kind, stage, mb)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="fb-backward-half", daemon=True)
        self._thread.start()

    # -- the pair ------------------------------------------------------------------------------------------
    def run(self, forward, backward, *, f_chunk: tuple[int, int], b_chunk: tuple[int, int],
            first: str = "F") -> None:
        """forward() here, backward() on the helper thread, `first` computing first (the executor starts with
        the half whose input is here: with fixed turns, CUDA, a late input of the first half would stall the
        other); returns when both are done. Each half opens its first span itself (`resume`), after waiting for
        its input."""
        with self._cv:
            self.active, self._turn, self._error = True, first, None
            self._done = {"F": False, "B": False}
            self._waiting = {"F": None, "B": None}
            self._fills = 0
        self._meta = {"F": ("F", *f_chunk), "B": ("B", *b_chunk)}
        self._names = {"F": span_name("F", *f_chunk), "B": span_name("B", *b_chunk)}
        self._jobs.put(backward)
        try:
            with self._cv:  # B first: the forward starts at the backward's first switch point
                while self._turn != "F" and self._error is None and not self._done["B"]:
                    self._cv.wait()
                if self._error is not None:
                    raise HalfAborted("the B half of the F&B pair failed")
            forward()
            self._close("F")
        except BaseException as err:  # noqa: BLE001 - hand any failure to the other half, then report it
            self._fail(err)
        finally:
            self._finish("F")
        with self._cv:
            while not self._done["B"]:
                self._cv.wait()
            err, self._error = self._error, None
        try:
            if err is None:
                while self._fill():  # the weight-grads no wait needed: the pair is not over before they ran
                    pass
        finally:
            with self._cv:
                self.active = False
        if err is not None:
            raise err

    def _loop(self) -> None:
        if self.dev is not None:
            self.dev.bind_thread()
        while True:
            job = self._jobs.get()
            if job is None:  # close()
                return
            with self._cv:
                while self._turn != "B" and self._error is None:
                    self._cv.wait()
                failed = self._error is not None
            try:
                if not failed:
                    job()
                    self._close("B")
            except BaseException as err:  # noqa: BLE001
                self._fail(err)
            finally:
                self._finish("B")

    def close(self) -> None:
        """End the helper thread (after the last pair; a process may build many runtimes)."""
        self._jobs.put(None)

    # -- switch points -------------------------------------------------------------------------------------
    def switch(self, side: str) -> None:
        """Called by `side` at a switch point: close its span, let the other half compute until it switches
        back (no-op outside a pair or once the other half is done)."""
        if not self.active:
            return
        self._close(side)
        other = "B" if side == "F" else "F"
        with self._cv:
            if self._error is not None:
                raise HalfAborted(f"the {other} half of the F&B pair failed")
            if self._done[other]:
                return
            self._turn = other
            self._cv.notify_all()
            while self._turn != side and self._error is None:
                self._cv.wait()
            if self._error is not None:
                raise HalfAborted(f"the {other} half of the F&B pair failed")

    def wait(self, side: str, handle) -> None:
        """`side` needs `handle`'s result. While it is in flight and the other half can compute (it is not parked
        on an unfinished op), the other half computes; when neither can, this thread blocks until *either* op
        completes (a WAIT span covers that time), so neither half's progress waits behind the other's."""
        comms = self.comms
        if not (self.active and self.dynamic):
            comms.wait(handle)
            return
        other = "B" if side == "F" else "F"
        wait_token, deadline = None, time.monotonic() + comms.timeout_s
        while not comms.completed(handle):
            if self._done[other]:
                if wait_token is not None:
                    self.recorder.end(wait_token)
                    wait_token = None
                if self._fill():
                    continue
                break  # nothing else to run: a plain blocking wait
            parked = self._waiting[other]
            if parked is None or comms.completed(parked):
                if wait_token is not None:
                    self.recorder.end(wait_token)
                    wait_token = None
                self._waiting[side] = handle
                try:
                    self.switch(side)
                finally:
                    self._waiting[side] = None
                continue
            if self._fill():
                continue
            if wait_token is None:
                wait_token = self.recorder.begin("WAIT", handle.stage, handle.mb, name=f"WAIT/{handle.name}")
            if not comms.wait_any([handle, parked], deadline - time.monotonic()):
                raise comms.timeout_error(handle)
        if wait_token is not None:
            self.recorder.end(wait_token)
        comms.wait(handle)

    def _fill(self) -> bool:
        """Neither half can compute (or, after both halves ended, what is left): run one deferred weight-gradient
        closure of the backward half instead of blocking. True if there was one."""
        fn = self.filler() if self.filler is not None else None
        if fn is None:
            return False
        kind, stage, mb = self._meta["B"]
        self._fills += 1
        token = self.recorder.begin("B.wfill", stage, mb, name=f"{self._names['B']}/L{self._fills}.wfill")
        fn()
        self.recorder.end(token)
        return True

    def resume(self, side: str, label: str) -> None:
        """`side` computes again from here: open its span named after `label` (e.g. L13.experts)."""
        if not self.active or not self.recorder.enabled:
            return
        kind, stage, mb = self._meta[side]
        # a process-wide NVTX range, not a push/pop: on CUDA autograd runs the backward half's nodes (and so its
        # switch points) on its own device thread, while the half itself began on the helper thread
        self._open[side] = self.recorder.begin(f"{kind}.{label.split('.', 1)[-1]}", stage, mb,
                                               name=f"{self._names[side]}/{label}", thread_bound=False)

    def _close(self, side: str) -> None:
        token = self._open[side]
        if token is not None:
            self._open[side] = None
            self.recorder.end(token)

    def _fail(self, err: BaseException) -> None:
        with self._cv:
            if self._error is None or isinstance(self._error, HalfAborted):
                if not isinstance(err, HalfAborted) or self._error is None:
                    self._error = err
            self._cv.notify_all()

    def _finish(self, side: str) -> None:
        with self._cv:
            self._done[side] = True
            if self._turn == side:
                self._turn = "B" if side == "F" else "F"
            self._cv.notify_all()
