"""The emulated CUDA device: the runtime's CUDA branch on CPU tensors, and per rank the program it issued.

Compute runs at once on the host. What CUDA would order on a stream becomes, here, either a host wait or a
deferred dependency:
* a wait parked on a stream the model computes on (the legacy default stream, the hp stream) blocks the host until
  the op completed, since the next kernel there reads its result now. This delays nothing a GPU would run earlier:
  on CUDA every later kernel of that stream waits for the op too, and every later post waits for that stream
  (the communication stream is ordered behind the compute stream before each post);
* on any other stream (communication, end and side streams) a wait is a deferred dependency: events recorded
  there complete when what the stream waits for did, and a host copy queued there reads its tensors only then.
Completion of a posted op is watched by one waiter thread per op (gloo reports P2P completion only from inside
`wait()`), stamped with the time it was seen, so timing events resolve as CUDA events do.

The program (traces.formats.cuda_program, docs/cuda_program.md) lists, in host order, each stream made (with the
flags asked for), each kernel (one per compute span, named after it), event record and wait, NCCL launch (its
communicator, members, ops and the storages it uses), stream-ordered wait for a launch, host wait, and each
release of a storage an NCCL launch used. Releases are seen through the tensors the runtime handed the backend:
the backend gets an alias (`backend_view`), so when the runtime drops its own reference the storage counts as
released, as on NCCL, where `Work.wait()` drops ProcessGroupNCCL's own.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from traces.formats.cuda_program import LEGACY, program_path, write_program

COMPUTE_ROLES = ("compute", "hp")
# torch.distributed's function names -> the program's collective kinds
_KINDS = {"all_to_all_single": "all_to_all", "all_gather_into_tensor": "all_gather",
          "reduce_scatter_tensor": "reduce_scatter"}  # streams the model's kernels run on: a wait there blocks the host


class _Done:
    """The completion of one posted op, set by its waiter thread."""

    __slots__ = ("flag", "t_ns", "error", "nccl_id")

    def __init__(self, nccl_id: int | None):
        self.flag = threading.Event()
        self.t_ns = 0
        self.error: BaseException | None = None
        self.nccl_id = nccl_id


class EmuStream:
    def __init__(self, dev: "EmulatedCuda", sid: int, role: str):
        self.dev, self.id, self.role = dev, sid, role
        self.pending: list[_Done] = []  # what work issued here so far waits for (deferred streams only)

    @property
    def compute(self) -> bool:
        return self.role in COMPUTE_ROLES

    def wait_event(self, event: "EmuEvent") -> None:
        self.dev._emit("wait_event", stream=self.id, event=event.id)
        if self.compute:
            self.dev._block(event.deps, "an event wait on a compute stream")
        else:
            self.pending = _merge(self.pending, event.deps)

    def wait_stream(self, other: "EmuStream") -> None:
        ev = self.dev.event()
        ev.record(other)
        self.wait_event(ev)

    def __repr__(self) -> str:
        return f"EmuStream({self.id}, {self.role})"


class EmuEvent:
    def __init__(self, dev: "EmulatedCuda"):
        self.dev = dev
        self.id = None
        self.deps: list[_Done] = []
        self.t_ns = 0
        self._seen = False

    def record(self, stream: EmuStream | None = None) -> None:
        stream = stream or self.dev.current_stream()
        self.id = next(self.dev._event_ids)
        self.deps = [d for d in stream.pending if not (d.flag.is_set() and d.error is None and d.t_ns)]
        self.t_ns = time.perf_counter_ns()
        self._seen = False
        self.dev._emit("record", stream=stream.id, event=self.id)

    def query(self) -> bool:
        done = all(d.flag.is_set() for d in self.deps)
        if done and not self._seen and self.id is not None:
            self._seen = True  # the host saw it complete: a host wait in the program
            self.dev._emit("host_wait", event=self.id)
        return done

    def done_ns(self) -> int:
        return max([self.t_ns, *(d.t_ns for d in self.deps)])

    def elapsed_time(self, end: "EmuEvent") -> float:
        return (end.done_ns() - self.done_ns()) / 1e6


def _merge(a: list[_Done], b: list[_Done]) -> list[_Done]:
    out = [d for d in a if not d.flag.is_set()]
    seen = {id(d) for d in out}
    out += [d for d in b if id(d) not in seen and not d.flag.is_set()]
    return out


class EmulatedCuda:
    name = "emulated-cuda"

    def __init__(self, rank: int, world: int, timeout_s: float):
        self.rank, self.world, self.timeout_s = rank, world, float(timeout_s)
        self.program: list[dict] = []
        self._lock = threading.Lock()
        self._tls = threading.local()
        self._stream_ids = itertools.count(1)
        self._event_ids = itertools.count(1)
        self._nccl_ids = itertools.count(0)
        self._storage_ids = itertools.count(1)
        self.legacy = EmuStream(self, LEGACY, "compute")
        # id(work) -> its completion. Only the watcher thread holds the work itself, until it completed: an emulated run
        # keeps no tensor alive past its op (gloo's work holds them). A later work may reuse a freed one's id: every
        # work is registered by post() before anyone looks it up, which replaces the stale entry.
        self._works: dict[int, _Done] = {}
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="emu-cuda-wait")
        self._views: dict[int, int] = {}  # id(backend alias) -> storage id
        self.stream_flags: dict[int, str] = {}

    # -- the program ---------------------------------------------------------------------------------------
    def _emit(self, op: str, **fields) -> None:
        fields["at"] = getattr(self._tls, "at", "")
        with self._lock:
            self.program.append({"op": op, **fields})

    def kernel(self, name: str) -> None:
        stream = self.current_stream()
        if stream.id == LEGACY:  # the pipeline action the thread is in (hp kernels are parts of one)
            self._tls.at = name
        self._emit("kernel", stream=stream.id, name=name)

    def mark(self, name: str) -> None:
        self._emit("mark", name=name)

    # -- streams and events --------------------------------------------------------------------------------
    def new_stream(self, role: str, priority: int = 0, blocking: bool = False) -> EmuStream:
        s = EmuStream(self, next(self._stream_ids), role)
        flags = "blocking" if blocking else "non-blocking"
        self.stream_flags[s.id] = flags
        self._emit("stream", stream=s.id, flags=flags, priority=priority, role=role)
        return s

    def current_stream(self) -> EmuStream:
        return getattr(self._tls, "stream", None) or self.legacy

    @contextlib.contextmanager
    def use(self, stream: EmuStream):
        before = getattr(self._tls, "stream", None)
        self._tls.stream = stream
        try:
            yield stream
        finally:
            self._tls.stream = before

    def event(self, timing: bool = False) -> EmuEvent:
        return EmuEvent(self)

    def host_wait_events(self, events, limit_s: float) -> bool:
        """The host blocks on `events`: in the program before it waits (a run that hangs here shows where)."""
        for ev in events:
            if ev.id is not None and not ev._seen:
                ev._seen = True
                self._emit("host_wait", event=ev.id)
        deadline = time.monotonic() + limit_s
        for ev in events:
            for d in ev.deps:
                if not d.flag.wait(max(0.0, deadline - time.monotonic())):
                    return False
            ev.query()
        return True

    def _block(self, deps: list[_Done], what: str, limit_s: float | None = None) -> None:
        deadline = time.monotonic() + (self.timeout_s if limit_s is None else limit_s)
        for d in deps:
            if not d.flag.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"timed out after {self.timeout_s:g} s in {what} (emulated CUDA)")
            if d.error is not None:
                raise d.error

    # -- posted work -----------------------------------------------------------------------------------------
    def post(self, post, *, comm: str, members: list[int], ops: list[tuple], tensors: list[torch.Tensor]) -> list:
        stream = self.current_stream()
        k = next(self._nccl_ids)
        storages = [self._views.pop(id(t), None) for t in tensors]
        self._emit("nccl", stream=stream.id, id=k, comm=comm, members=sorted(members),
                   ops=[{"kind": _KINDS.get(kind, kind), "name": name, **({"peer": peer} if peer is not None else {})}
                        for kind, peer, name in ops], storages=[s for s in storages if s is not None])
        works = post()  # a list (a P2P batch) or one work (a collective)
        # One launch completes as one, whichever of its works the runtime holds: NCCL runs a grouped batch as one
        # kernel (ProcessGroupNCCL returns one coalesced work), so nothing ordered behind any op of the batch runs
        # before all of its ops ran; gloo returns a work per op and completes a receive as soon as its own message
        # came. Per-op completion here let a stream reused behind one receive of a batch look idle while the
        # batch's other receive was still unsent: a host wait a GPU never makes, and a cycle in the replay.
        unique = list({id(w): w for w in (works if isinstance(works, list) else [works])}.values())
        done = _Done(k)
        for work in unique:
            self._works[id(work)] = done
        self._pool.submit(self._watch, unique, done)
        return works

    def _watch(self, works: list, done: _Done) -> None:
        import datetime

        deadline = time.monotonic() + self.timeout_s
        try:
            for work in works:
                left = datetime.timedelta(seconds=max(0.001, deadline - time.monotonic()))  # 0 means no limit
                if work.wait(left) is False:
                    done.error = TimeoutError("the backend timed out")
                    break
        except BaseException as err:  # noqa: BLE001 - handed to whoever waits for it
            done.error = err
        finally:
            done.t_ns = time.perf_counter_ns()
            done.flag.set()

    def _done(self, work) -> _Done:
        done = self._works.get(id(work))
        if done is None:
            raise RuntimeError("emulated CUDA: a work that was not posted through the device layer")
        return done

    def wait_work(self, work, stream: EmuStream | None = None) -> None:
        stream = stream or self.current_stream()
        done = self._done(work)
        self._emit("wait_nccl", stream=stream.id, id=done.nccl_id)
        if stream.compute:
            self._block([done], "a stream-ordered wait on a compute stream")
        else:
            stream.pending = _merge(stream.pending, [done])

    def work_done(self, work) -> bool:
        return self._done(work).flag.is_set()

    def host_wait_work(self, work, limit_s: float) -> bool:
        done = self._done(work)
        self._emit("host_wait", id=done.nccl_id)
        if not done.flag.wait(limit_s):
            return False
        if done.error is not None:
            raise done.error
        return True

    def read_later(self, tensors, stream: EmuStream):
        self._emit("kernel", stream=stream.id, name="D2H copy")
        done = self.event()
        done.record(stream)
        return done, (lambda: torch.cat(tensors) if len(tensors) > 1 else tensors[0].clone())

    def backend_view(self, t: torch.Tensor) -> torch.Tensor:
        sid = next(self._storage_ids)
        alias = t.detach()
        self._views[id(alias)] = sid
        weakref.finalize(t, self._emit, "release", storage=sid, stream=LEGACY)
        return alias

    # -- the rest of the interface ---------------------------------------------------------------------------
    def record_stream(self, t, stream) -> None:
        pass  # the emulated device never reuses memory early

    def pinned(self, t):
        return t

    def bind_thread(self) -> None:
        pass

    def reset_peak_memory(self) -> None:
        pass

    def peak_memory(self) -> int | None:
        return None

    def rng_state(self) -> torch.Tensor | None:
        return None  # tensors live on the CPU: its generator is the one a recompute replays

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        pass

    def close(self, program_dir: Path | None = None, complete: bool = True) -> Path | None:
        """Stop the waiter threads; write the program into `program_dir` (a run's trace folder) when given.
        `complete=False`: the run failed (a timeout, a dead peer) and the program ends where this rank stopped."""
        self._pool.shutdown(wait=False)
        if program_dir is None:
            return None
        with self._lock:
            prog = list(self.program)
        path = program_path(Path(program_dir), self.rank)
        write_program(path, self.rank, self.world, prog, complete)
        return path
