"""Recording: one NVTX range and one `traces.Span` per schedule action, comm op, recompute and hp post+res.

Names follow traces.md §5 (`F/s3/mb7`, `FB/s3/mb7+s4/mb2`, `SEND_F/s3/mb7~comm`, `RC/s3/mb7`,
`F/s3/mb7/L12.post_res~hp`, one outer `step/K`). Times are microseconds from the rank's clock zero, taken
at a common instant (`align`), so per-rank files merge into one timeline: ranks on one host read the same
monotonic clock and share the earliest rank's zero (exact); across hosts the barrier's exit is the common instant
(off by the barrier's exit jitter, milliseconds on a loaded host).

CPU: `time.perf_counter_ns`; a comm span ends when the backend reported completion (pipeline.distributed.comm) and a
`WAIT` span covers the time the compute thread blocked on it. CUDA: events recorded on the span's stream (the
high-priority stream for `~hp` ranges), resolved in `flush_step` once they completed (polled with a deadline);
comm spans start with an event on the communication stream and end with one on a stream ordered behind the
transfer (pipeline.distributed.comm), and a `WAIT` is the compute stream's stall. The events come from the device
layer (pipeline.device): under the emulated CUDA device they resolve to the host times at which what they wait for
completed, and each compute span's start is a kernel of the emulated program, named after the span. Spans come
from the two threads of an overlapped F&B pair, one at a time (pipeline.runtime.overlap). The `nvtx` package is
optional: without it (or without a profiler attached, where its calls cost little) only spans are kept. NVTX
domain `mhc_pipe`, category = op kind.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from traces import Span, Trace
from traces.formats.io import load_trace, save_trace

try:  # optional: ranges are only useful under nsys, spans are always recorded
    import nvtx as _nvtx
except Exception:  # noqa: BLE001
    _nvtx = None

DOMAIN = "mhc_pipe"
_COLORS = {"F": "orange", "I": "green", "B": "green", "W": "blue", "FB": "yellow", "RC": "purple",
           "SEND_F": "grey", "RECV_F": "grey", "SEND_B": "grey", "RECV_B": "grey", "step": "white"}


class Recorder:
    def __init__(self, rank: int, device: torch.device, enabled: bool = True, dev=None):
        self.rank = rank
        self.device = device
        self.enabled = enabled
        self.dev = dev  # pipeline.device: CUDA (or emulated CUDA) events; None: host clock
        self.cuda = dev is not None
        self.spans: list[Span] = []
        self._open: list[tuple] = []  # CUDA: (kind, stage, mb, stream, partner, peer, name, comm, ev0, ev1)
        self._t0_ns = time.perf_counter_ns()
        self._cuda_offset_us = 0.0
        self._ref_event = None

    # -- clocks ------------------------------------------------------------------------------------------
    def align(self, common_zero_ns: int | None = None) -> None:
        """Call right after a barrier: this instant is time zero of the rank's spans, or `common_zero_ns` (a
        `time.perf_counter_ns` value) when every rank runs on this host and so reads the same monotonic clock."""
        now = time.perf_counter_ns()
        self._t0_ns = now if common_zero_ns is None else common_zero_ns
        self._cuda_offset_us = (now - self._t0_ns) / 1e3  # the CUDA reference event is recorded now
        if self.cuda:
            self._ref_event = self.dev.event(timing=True)
            self._ref_event.record()

    def _now_us(self) -> float:
        return (time.perf_counter_ns() - self._t0_ns) / 1e3

    # -- ranges ------------------------------------------------------------------------------------------
    def begin(self, kind: str, stage: int | None, mb: int | None, *, stream: str = "compute",
              partner: tuple[int, int] | None = None, peer: int | None = None, name: str,
              cuda_stream=None, nvtx: bool = True, thread_bound: bool = True, comm: tuple | None = None) -> tuple:
        """Open a span (and an NVTX range). `thread_bound=False`: the range may end on another thread than the
        one that opened it (an F&B pair's halves: autograd runs CUDA backward nodes on its own thread), so it is
        a process-wide NVTX start/end range, not a push/pop on this thread's stack. `comm`: (group, batch) of a
        communication span."""
        nv = None
        if self.dev is not None and stream in ("compute", "hp") and kind != "WAIT":
            self.dev.kernel(name)  # the program's name for what the stream runs from here
        if _nvtx is not None and nvtx:
            color, category = _COLORS.get(kind.split(".")[0], "purple"), kind.split(".")[0]
            if thread_bound:
                _nvtx.push_range(name, color=color, domain=DOMAIN, category=category)
                nv = True
            else:
                nv = _nvtx.start_range(name, color=color, domain=DOMAIN, category=category)
        if not self.enabled:
            return (kind, nv)
        if self.cuda:
            ev = self.dev.event(timing=True)
            ev.record(cuda_stream) if cuda_stream is not None else ev.record()
            start = ev
        else:
            start = self._now_us()
        return (kind, nv, stage, mb, stream, partner, peer, name, start, cuda_stream, comm)

    def end(self, token: tuple, *, pop: bool = True, end_ns: int | None = None) -> None:
        """Close a span now, or (CPU) at `end_ns`, a `time.perf_counter_ns` reading taken earlier."""
        nv = token[1]
        if nv is not None and pop:
            if nv is True:
                _nvtx.pop_range(domain=DOMAIN)
            else:
                _nvtx.end_range(nv)
        if not self.enabled:
            return
        kind, _, stage, mb, stream, partner, peer, name, start, cuda_stream, comm = token
        if self.cuda:
            ev = self.dev.event(timing=True)
            ev.record(cuda_stream) if cuda_stream is not None else ev.record()
            self._open.append((kind, stage, mb, stream, partner, peer, name, comm, start, ev))
        else:
            now = self._now_us() if end_ns is None else (end_ns - self._t0_ns) / 1e3
            g, b = comm if comm is not None else (None, None)
            self.spans.append(Span(self.rank, stream, kind, stage, mb, start, max(0.0, now - start), partner, peer,
                                   name, g, b))

    def range(self, kind: str, stage: int | None, mb: int | None, **kw):
        return _Range(self, kind, stage, mb, kw)

    def begin_async(self, kind: str, stage: int, mb: int, peer: int | None, name: str, group: str | None = None,
                    batch: int | None = None, cuda_stream=None) -> tuple:
        """A comm span (stream "comm"): begun at post (CUDA: an event on `cuda_stream`, the communication
        stream); an NVTX mark, not a range, since it overlaps the compute ranges of the same thread. `group`,
        `batch`: the process group's name and the op's batch number on it (traces.analysis.comm_replay)."""
        if _nvtx is not None:
            _nvtx.mark(name, color="grey", domain=DOMAIN, category="P2P")
        if not self.enabled:
            return (kind, None)
        if self.cuda:
            start = self.dev.event(timing=True)
            start.record(cuda_stream) if cuda_stream is not None else start.record()
        else:
            start = self._now_us()
        return (kind, None, stage, mb, "comm", None, peer, name, start, cuda_stream, (group, batch))

    def end_async(self, token: tuple, end_ns: int | None = None, cuda_stream=None) -> None:
        """Close a comm span: CPU at its completion time `end_ns` when the backend reported it, else now; CUDA
        with an event on `cuda_stream` (a stream ordered behind the transfer), else on the span's own stream."""
        if self.cuda and cuda_stream is not None and self.enabled:
            token = token[:9] + (cuda_stream,) + token[10:]
        self.end(token, pop=False, end_ns=end_ns)

    # -- output ------------------------------------------------------------------------------------------
    def flush_step(self, timeout_s: float = 300.0) -> None:
        """CUDA: resolve this step's events into spans, once every one of them has completed (polled, at most
        `timeout_s`). A stream-ordered `WAIT` whose stream did not stall (under a microsecond) is dropped."""
        if not self._open:
            return
        from pipeline.distributed.collective import wait_events

        wait_events([ev for *_, ev0, ev1 in self._open for ev in (ev0, ev1)], timeout_s,
                    "resolving the step's CUDA events", self.rank, self.dev)
        ref = self._ref_event
        for kind, stage, mb, stream, partner, peer, name, comm, ev0, ev1 in self._open:
            start = ref.elapsed_time(ev0) * 1e3 + self._cuda_offset_us
            dur = max(0.0, ev0.elapsed_time(ev1) * 1e3)
            if kind == "WAIT" and dur < 1.0:
                continue
            g, b = comm if comm is not None else (None, None)
            self.spans.append(Span(self.rank, stream, kind, stage, mb, start, dur, partner, peer, name, g, b))
        self._open.clear()

    def save(self, path: Path, meta: dict) -> Path:
        self.flush_step()
        return save_trace(Trace(sorted(self.spans, key=lambda s: (s.start, s.stream)), meta), path)


class _Range:
    __slots__ = ("rec", "args", "token")

    def __init__(self, rec: Recorder, kind, stage, mb, kw):
        self.rec, self.args = rec, (kind, stage, mb, kw)

    def __enter__(self):
        kind, stage, mb, kw = self.args
        self.token = self.rec.begin(kind, stage, mb, **kw)
        return self

    def __exit__(self, *exc):
        self.rec.end(self.token)
        return False


def merge_rank_traces(paths: list[Path], out: Path, meta: dict) -> Path:
    """Merge per-rank trace files (already on a common clock) into one measured trace."""
    spans: list[Span] = []
    groups: dict[str, list[int]] = {}
    for p in paths:
        t = load_trace(p)
        spans.extend(t.spans)
        groups.update(t.meta.get("comm_groups") or {})  # each rank knows its own groups
    if groups:
        meta = {**meta, "comm_groups": dict(sorted(groups.items()))}
    if not spans:
        raise ValueError(f"no spans in {', '.join(map(str, paths))}")
    return save_trace(Trace(sorted(spans, key=lambda s: (s.start, s.rank, s.stream)), meta), out)


def rank_trace_path(trace_dir: Path, rank: int, fmt: str = "json") -> Path:
    """rank<r>.json, or rank<r>.npz (train.trace_format)."""
    return Path(trace_dir) / f"rank{rank}.{fmt}"
