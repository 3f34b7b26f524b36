"""The strict transport: gloo P2P run under NCCL's execution rules, so that a CPU run fails where NCCL would hang.

NCCL runs the operations of one communicator in posting order, one batch at a time (a `batch_isend_irecv` group
or a collective), and a send completes only while the matching receive runs (for messages beyond NCCL's
buffers: every real activation). gloo buffers sends, so a posting order that deadlocks on NCCL completes on gloo
and no plain CPU test can see it. Under this transport every P2P batch a rank posts goes to a FIFO queue instead
of straight to gloo:
* view "group" (`train.comm_rules: nccl`): one queue per process group, as ProcessGroupNCCL runs a batch on the
  group's own communicator;
* view "pair" (`nccl-pair`): one queue per (group, peer), as ProcessGroupNCCL gives single P2P ops a two-rank
  communicator per rank pair, shared by both directions.
A batch runs once it is at the head of its queue: each of its receives first tells the sender that it is running
(a small message naming the message key, shape and dtype it expects), then receives the data; each send waits for
that message, checks that it names what it sends (else an order mismatch: NCCL would deliver the wrong tensor or
hang) and only then sends. The batch completes when all its ops did, and all its handles complete together (NCCL
coalesces a batch into one work). Messages of one batch are handled in its order, which is exact for the batches
the runtime posts (all receives, or sends to one peer).

NCCL connects lazily: the first op to a peer on a communicator blocks the posting host until the peer posts on that
communicator too, and the first collective on a group blocks until every member posts one. `post` and
`note_collective` run in the posting thread and block there the same way (through the job's store), so a posting
order whose first messages wait for each other hangs here as it would on NCCL (the runtime's start-up warm-up,
pipeline.distributed.warmup, connects everything once in one global order so that no later post connects).

Hangs become one line: each rank publishes the head batch of every queue (what it waits for, since when) to the
job's TCPStore whenever it changes (a thread, twice a second), and a wait that times out appends every rank's
heads to its error (`hang_report`).

Collectives keep their backend's semantics but are compared: each rank notes the kind, dtype and trailing shape of
every collective it posts on each group, and at the end of every step the members compare their lists through the
store; the first difference is an error naming both ranks' ops. TORCH_DISTRIBUTED_DEBUG=DETAIL checks the same for
gloo collectives, but blocking, at post time: an F&B pair's half that posts an all-to-all would then hold the
compute turn until every peer had posted its own, which NCCL's asynchronous posting never does, so a correct
overlapped pair would hang under it.
"""
from __future__ import annotations

import datetime
import itertools
import json
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pipeline.distributed.errors import PipelineError, describe
from traces.nccl_rules import VIEWS, message_key, queue_of

READY_TAG, DATA_TAG = 1, 2  # gloo honours tags: the "receive is running" notes and the data never cross
_NOTE_BYTES = 192
_instances = itertools.count()  # one key prefix per transport (several runtimes in one process: A/B runs)


@dataclass
class _Op:
    is_send: bool
    name: str  # SEND_F/s0/mb3, RECV_B/s1/mb0
    peer: int  # global rank
    tensor: torch.Tensor  # what gloo reads or fills (a host tensor)

    @property
    def key(self) -> str:
        """The message key both ends name: F/s0/mb3 for SEND_F/s0/mb3 and RECV_F/s0/mb3 (traces.nccl_rules)."""
        return message_key(self.name)

    def note(self) -> dict:
        return {"key": self.key, "shape": list(self.tensor.shape), "dtype": str(self.tensor.dtype)}


class StrictWork:
    """One batch's work: completes when every op of the batch did (or fails with the batch's error)."""

    def __init__(self):
        self._done = threading.Event()
        self._future = torch.futures.Future()
        self.error: BaseException | None = None

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()
        if error is None:
            self._future.set_result(None)
        else:
            self._future.set_exception(error)

    def get_future(self):
        return self._future

    def is_completed(self) -> bool:
        if self._done.is_set() and self.error is not None:
            raise self.error
        return self._done.is_set()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        ok = self._done.wait(None if timeout is None else timeout.total_seconds())
        if ok and self.error is not None:
            raise self.error
        return ok


@dataclass
class _Batch:
    queue: str
    ops: list[_Op]
    group: dist.ProcessGroup | None
    work: StrictWork
    state: str = "queued"
    since_wall: float = field(default_factory=time.time)


class StrictTransport:
    """The queues of one rank. `post(group, group_name, ops)` enqueues a batch and returns its `StrictWork`."""

    def __init__(self, rank: int, world: int, timeout_s: float, view: str = "group", store=None):
        if view not in VIEWS:
            raise ValueError(f"strict transport view {view!r}: use {' or '.join(map(repr, VIEWS))}")
        self.rank, self.world, self.view = rank, world, view
        self.timeout_s = float(timeout_s)
        self._queues: dict[str, deque[_Batch]] = {}
        self._cv = threading.Condition()
        self._threads: dict[str, threading.Thread] = {}
        self._version = 0
        self._closed = False
        self._prefix = f"mhcpipe-strict/{_job_token()}/{next(_instances)}"
        self.store = store if store is not None else _job_store(timeout_s)
        self._collectives: dict[str, list[str]] = {}  # group name -> this step's collective fingerprints
        self._members: dict[str, list[int]] = {}
        self._step = 0
        self._connected: set = set()  # (queue, peer) and group names this rank has connected (lazy connect rule)
        self._connecting: tuple[str, str, float] | None = None  # (queue, what it waits for, since): for the heads
        if self.store is not None:
            threading.Thread(target=self._publish_loop, name="strict-heads", daemon=True).start()

    # -- P2P -------------------------------------------------------------------------------------------------
    def post(self, group, group_name: str, ops: list[tuple[bool, str, int, torch.Tensor]]) -> StrictWork:
        """Enqueue one batch of (is_send, name, peer global rank, host tensor) on `group`."""
        work = StrictWork()
        parts: dict[str, list[_Op]] = {}
        for is_send, name, peer, tensor in ops:
            if tensor.device.type != "cpu":
                raise PipelineError(f"rank {self.rank}: the strict transport runs gloo on host tensors; {name} is "
                                    f"on {tensor.device} (use it on CPU runs)")
            queue = queue_of(self.view, group_name, f"{min(self.rank, peer)}-{max(self.rank, peer)}")
            parts.setdefault(queue, []).append(_Op(is_send, name, peer, tensor))
        for queue, part in parts.items():
            for op in part:
                self._connect(queue, op)
        batches = [_Batch(q, part, group, work if len(parts) == 1 else StrictWork()) for q, part in parts.items()]
        if len(batches) > 1:  # pair view split one batch over peers: the caller's work completes with all parts
            _join(work, [b.work for b in batches])
        with self._cv:
            for b in batches:
                self._queues.setdefault(b.queue, deque()).append(b)
                if b.queue not in self._threads:
                    t = threading.Thread(target=self._run_queue, args=(b.queue,), name=f"strict-{b.queue}",
                                         daemon=True)
                    self._threads[b.queue] = t
                    t.start()
            self._version += 1
            self._cv.notify_all()
        return work

    def _connect(self, queue: str, op: _Op) -> None:
        """NCCL's lazy connection: the first op to `op.peer` on this communicator blocks the poster until the peer
        has posted its own first op to this rank on it."""
        if self.store is None or (queue, op.peer) in self._connected:
            return
        self._connected.add((queue, op.peer))
        self.store.set(f"{self._prefix}/conn/{queue}/{self.rank}>{op.peer}", op.name)
        self._await_connect(queue, f"{op.name} connects: waits for rank {op.peer}'s first op on this communicator",
                            [f"{self._prefix}/conn/{queue}/{op.peer}>{self.rank}"],
                            f"the first op to rank {op.peer} on {queue} ({op.name})",
                            f"rank {op.peer} never posted on that communicator")

    def _await_connect(self, queue: str, state: str, keys: list[str], what: str, why: str) -> None:
        with self._cv:
            self._connecting = (queue, state, time.time())
            self._version += 1
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.timeout_s))
        except Exception:  # noqa: BLE001 - the store's timeout has no public type
            raise PipelineError(f"rank {self.rank}: {what} blocked {self.timeout_s:g} s connecting: NCCL connects "
                                f"lazily and {why}; {self.hang_report()}") from None
        finally:
            with self._cv:
                self._connecting = None
                self._version += 1

    def _run_queue(self, queue: str) -> None:
        q = self._queues[queue]
        while True:
            with self._cv:
                while not q and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                batch = q[0]
                batch.state, batch.since_wall = "running", time.time()
                self._version += 1
            error, cause = None, ""
            try:
                self._run_batch(batch)
            except BaseException as err:  # noqa: BLE001 - handed to whoever waits for the batch
                cause = str(err) if isinstance(err, PipelineError) else describe(err)
                error = err if isinstance(err, PipelineError) else PipelineError(
                    f"rank {self.rank}: {', '.join(o.name for o in batch.ops)} failed: {cause}")
            with self._cv:
                if error is None:
                    q.popleft()
                else:  # stays at the head, so the heads report says what broke this queue
                    batch.state = f"failed ({cause})"
                self._version += 1
            batch.work.finish(error)
            if error is not None:
                return  # this queue is broken; its later batches fail by timeout with the heads report

    def _run_batch(self, batch: _Batch) -> None:
        g, limit = batch.group, datetime.timedelta(seconds=self.timeout_s + 30.0)
        recvs = [op for op in batch.ops if not op.is_send]
        if recvs:
            batch.state = "waits for " + ", ".join(f"rank {op.peer}'s send of {op.key}" for op in recvs)
        pending = []
        for op in batch.ops:  # receives: announce that they run, then take the data
            if not op.is_send:
                note = _encode(op.note())
                pending.append(dist.isend(note, op.peer, group=g, tag=READY_TAG))
                pending.append(dist.irecv(op.tensor, op.peer, group=g, tag=DATA_TAG))
        notes = [(op, torch.empty(_NOTE_BYTES, dtype=torch.uint8)) for op in batch.ops if op.is_send]
        waits = [dist.irecv(buf, op.peer, group=g, tag=READY_TAG) for op, buf in notes]
        for (op, buf), w in zip(notes, waits):  # sends: only once the matching receive runs
            batch.state = f"waits for rank {op.peer} to run the receive of {op.key}"
            w.wait(limit)
            theirs = _decode(buf)
            mine = op.note()
            if theirs != mine:
                raise PipelineError(
                    f"rank {self.rank}: NCCL order mismatch on {batch.queue}: its next send to rank {op.peer} is "
                    f"{op.key} {mine['dtype']}{mine['shape']}, but rank {op.peer}'s next receive from it is "
                    f"{theirs.get('key')} {theirs.get('dtype')}{theirs.get('shape')} (NCCL would deliver the wrong "
                    "tensor or hang)")
            pending.append(dist.isend(op.tensor.contiguous(), op.peer, group=g, tag=DATA_TAG))
        if not recvs:
            batch.state = "transfers"
        for w in pending:
            w.wait(limit)

    # -- collectives -----------------------------------------------------------------------------------------
    def note_collective(self, group_name: str, members: list[int], fn_name: str, name: str, tensors) -> None:
        """Remember one collective posted on `group_name` (kind, dtype, shape without the first dimension, which
        uneven all-to-all splits let differ) for the end-of-step comparison."""
        t = next((x for x in tensors if torch.is_tensor(x)), None)
        shape = "" if t is None else f"{t.dtype}{list(t.shape[1:])}"
        self._members.setdefault(group_name, members)
        if self.store is not None and group_name not in self._connected:  # lazy connect: every member posts
            self._connected.add(group_name)
            self.store.set(f"{self._prefix}/conn-coll/{group_name}/{self.rank}", name)
            self._await_connect(group_name, f"{name} connects: waits for every member's first collective",
                                [f"{self._prefix}/conn-coll/{group_name}/{m}" for m in members if m != self.rank],
                                f"the first collective on {group_name} ({name})",
                                "not every member posted its first collective on it")
        self._collectives.setdefault(group_name, []).append(f"{fn_name} {shape} ({name})")

    def forget_collectives(self) -> None:
        """Drop the collectives noted so far (the start-up warm-up's, which belong to no step)."""
        self._collectives = {}

    def check_collectives(self) -> None:
        """End of a step: every member of each group posted the same collectives in the same order, or a
        PipelineError naming the first difference."""
        step, self._step = self._step, self._step + 1
        mine, self._collectives = self._collectives, {}
        if self.store is None:
            return
        for gname, ops in mine.items():
            self.store.set(f"{self._prefix}/coll/{step}/{gname}/{self.rank}", json.dumps(ops))
        limit = datetime.timedelta(seconds=self.timeout_s)
        for gname, ops in mine.items():
            for m in self._members[gname]:
                if m == self.rank:
                    continue
                key = f"{self._prefix}/coll/{step}/{gname}/{m}"
                try:
                    self.store.wait([key], limit)
                except Exception as err:  # noqa: BLE001 - the store's timeout has no public type
                    raise PipelineError(f"rank {self.rank}: rank {m} posted no collectives on {gname} in step "
                                        f"{step} while this rank posted {len(ops)} ({describe(err)})") from None
                theirs = json.loads(self.store.get(key))
                for k, (a, b) in enumerate(itertools.zip_longest(ops, theirs)):
                    if _kind(a) != _kind(b):
                        raise PipelineError(
                            f"rank {self.rank}: collective order mismatch on {gname} in step {step}: its "
                            f"collective #{k + 1} is {a or 'missing'}, rank {m}'s is {b or 'missing'} (NCCL would "
                            "pair them up: a hang or wrong sums)")

    # -- hang report -----------------------------------------------------------------------------------------
    def _heads(self) -> list[tuple[str, float]]:
        """This rank's non-empty queues: (head batch and its state, wall time it entered that state)."""
        with self._cv:
            out = []
            if self._connecting is not None:
                queue, state, since = self._connecting
                out.append((f"[{queue}] {state} (%.1f s)", since))
            for name, q in self._queues.items():
                if q:
                    b = q[0]
                    behind = ""
                    if len(q) > 1:
                        more = f" (+{len(q) - 2} more)" if len(q) > 2 else ""
                        behind = f"; behind it {'+'.join(o.name for o in q[1].ops)}{more}"
                    out.append((f"[{name}] {'+'.join(o.name for o in b.ops)} {b.state} (%.1f s){behind}",
                                b.since_wall))
            return out

    def heads(self) -> list[str]:
        now = time.time()
        return [text % (now - since) for text, since in self._heads()]

    def _publish_loop(self) -> None:
        seen = -1
        while not self._closed:
            version = self._version
            if version != seen:
                try:
                    self.store.set(f"{self._prefix}/heads/{self.rank}", json.dumps(self._heads()))
                    seen = version
                except Exception:  # noqa: BLE001 - the job is going down; the report says what it has
                    return
            time.sleep(0.5)

    def hang_report(self) -> str:
        """One line: every rank's queue heads (its own as of now, the others' as last published)."""
        now = time.time()
        parts = [f"rank {self.rank}: {'; '.join(self.heads()) or 'no P2P queued'}"]
        if self.store is not None:
            for r in range(self.world):
                if r == self.rank:
                    continue
                key = f"{self._prefix}/heads/{r}"
                try:
                    heads = json.loads(self.store.get(key)) if self.store.check([key]) else None
                except Exception:  # noqa: BLE001 - the store's host may be gone with its rank
                    heads = None
                text = "no report" if heads is None else "; ".join(t % (now - since) for t, since in heads)
                parts.append(f"rank {r}: {text or 'no P2P queued'}")
        return f"NCCL-rules queue heads ({self.view} view): " + " | ".join(parts)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()


def _kind(fingerprint: str | None) -> str | None:
    return None if fingerprint is None else fingerprint.split(" (", 1)[0]


def _join(work: StrictWork, parts: list[StrictWork]) -> None:
    left = [len(parts)]
    lock = threading.Lock()

    def one(fut) -> None:
        err = None
        try:
            fut.wait()
        except BaseException as e:  # noqa: BLE001
            err = e
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if err is not None and not work._done.is_set():
            work.finish(err)
        elif last and not work._done.is_set():
            work.finish()

    for p in parts:
        p.get_future().then(one)


def _encode(note: dict) -> torch.Tensor:
    raw = json.dumps(note, separators=(",", ":")).encode()
    if len(raw) > _NOTE_BYTES:
        raise PipelineError(f"strict transport: message note too long ({len(raw)} bytes): {note}")
    buf = torch.zeros(_NOTE_BYTES, dtype=torch.uint8)
    buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf


def _decode(buf: torch.Tensor) -> dict:
    raw = bytes(buf.tolist()).rstrip(b"\0")
    try:
        return json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {"key": f"<unreadable note {raw[:40]!r}>"}


def _job_token() -> str:
    """A word every rank of this job shares and no earlier job on the same store used (rank 0's, broadcast): the
    store's keys of an earlier job (a test's rank processes run many) must never answer this one's waits. Every
    rank makes its transport at the same point of its start-up, so the broadcast is collective."""
    import uuid

    if not dist.is_initialized():
        return "local"
    token = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    return token[0]


def _job_store(timeout_s: float):
    """A client of the job's TCPStore (torchrun's or the launcher's, at MASTER_ADDR:MASTER_PORT), or None."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    try:
        return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - without it the report names this rank's own heads only
        return None
