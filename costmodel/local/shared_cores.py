"""Simulation of a schedule whose ranks share the host's CPU cores: processor sharing that changes in time.

Why: the P ranks of a local run (gloo, one torch thread each) share fewer than P cores. How much one compute
action is slowed depends on how many ranks compute at that moment, and that changes along the schedule: the
warm-up and cool-down of a pipeline have few busy ranks, the steady state has all of them. Here every computing
rank progresses at

    rate(k) = min(1, cores(k) / k),   k = ranks computing now (capacity: cores(k) = their summed rate),

re-evaluated whenever an action starts or ends. cores(k) is the measured throughput of k concurrent
single-thread processes in units of one process alone (core_sharing.measure_core_sharing); it is not simply
min(k, cores) on a shared VM.

The OS does not share a core as a fluid, though. With `slice_us` > 0 the simulation schedules the ranks the
way Linux's scheduler does: the host has `slots` = round(max cores(k)) cores; a rank holds one while it
computes, keeps it from one action to the next while its next action is ready, and gives it back when it waits
for a message. A rank that takes a core is protected for `protect_us` (the base slice;
core_sharing.measure_protection); after that, the scheduler tick (every `slice_us`;
core_sharing.measure_time_slice) hands its core to a rank waiting for one. A rank that wakes up (its message
arrived) goes first in line: it slept, so it has used the least CPU time. A rank that posts a message to a rank
blocked waiting for one gives its core up at once when its protection is over: on loopback TCP the receiver is
woken inside the sender's send call, on the sender's core, and preempts it; it takes a core again, with a fresh
protection, as soon as one is free. A rank on a core progresses at min(1, cores(m) / m), m = min(k, slots)
ranks on cores; what k > slots busy processes lose beyond that (cores(k) < cores(slots)) is lost at the
switches: a rank taking a core from another first loses slice x slots x (1 - cores(k) / cores(slots)) /
min(k - slots, slots), so that k always-ready ranks progress at exactly cores(k) in total, with
min(k - slots, slots) switches per tick. What this gets right and the fluid model does not: a rank that wakes
while the cores are taken waits *before* its action (the span starts late, with its work at full speed), an
action is stretched only by the time it loses at ticks, and an action's speed does not depend on how many
ranks wait. slice_us = 0 is the fluid model. (bench/predict_local.py measures how close each variant of this
model comes to real runs.)

Semantics are those of schedules.simulate (the needs/produces of schedules.deps, non-blocking posts, FIFO
channels per (src, dst) in the sender's program order, a transfer starts when both sides posted and the channel
is free). Differences: a compute action is given as *work* (us at full speed), preceded by the executor's gap
on its rank (CPU work too, not part of the span), and transfers take a fixed time without using the cores.
This is an event loop over the whole run (not the pointer walk of schedules.simulate), fine for the few
hundred actions of a local run.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from schedules.deps import Topology, needs, produces
from schedules.ir import COMM_KINDS, Action, Kind, Schedule
from schedules.registry import trace_meta
from schedules.simulate import SimResult, peak_live_activations
from schedules.validate import check_structure, raise_deadlock
from traces.trace import Span, Trace

_SEND = {Kind.SEND_F: ("XF", Kind.RECV_F), Kind.SEND_B: ("XG", Kind.RECV_B)}


def capacity(cores: Sequence[float]) -> Callable[[int], float]:
    """cores(k), the summed progress rate of k computing ranks; the last value holds for larger k."""
    if not cores or any(c <= 0 for c in cores):
        raise ValueError(f"cores by concurrency must be positive numbers, got {list(cores)}")
    table = [float(c) for c in cores]
    return lambda k: min(float(k), table[min(k, len(table)) - 1])


@dataclass
class _Running:
    action: Action
    gap_left: float  # executor work before the action (us at full speed)
    work_left: float
    posted: float  # when the rank took the action up (gap starts)
    started: float | None = None  # when the gap ended: the span's start
    mid: float | None = None  # FB: work left when its forward half ends (its output is sent then)


class _Channels:
    """The FIFO message channels per (src, dst), in the sender's program order (schedules.simulate's semantics):
    a transfer starts when both sides posted and the channel is free, and takes a fixed time."""

    def __init__(self, programs: list[list[Action]], transfer_time: Callable[[Action], float]):
        self.transfer_time = transfer_time
        channel_of: dict[tuple[int, int], int] = {}
        self.messages: list[list[tuple[tuple, Action]]] = []  # per channel: (delivered key, RECV action)
        self.slot: dict[tuple, tuple[int, int]] = {}  # delivered key -> (channel, index in it)
        for src, acts in enumerate(programs):
            for a in acts:
                if a.kind in _SEND:
                    ch = channel_of.setdefault((src, a.peer), len(self.messages))
                    if ch == len(self.messages):
                        self.messages.append([])
                    tag, recv_kind = _SEND[a.kind]
                    key = (tag, a.stage, a.mb)
                    self.slot[key] = (ch, len(self.messages[ch]))
                    self.messages[ch].append((key, Action(recv_kind, a.stage, a.mb, -1, -1, src)))
        self.send_at = [[None] * len(m) for m in self.messages]
        self.recv_at = [[None] * len(m) for m in self.messages]
        self.head = [0] * len(self.messages)
        self.free_at = [0.0] * len(self.messages)
        self.ends = {ch: ends for ends, ch in channel_of.items()}
        self.durations: dict[Kind, float] = {}
        self.arrivals: list[tuple[float, int, tuple]] = []  # (time, tie-break, delivered key)

    def post(self, key: tuple, t: float, send: bool, spans: list[Span]) -> None:
        """One side of message `key` is posted at t; start every transfer of its channel that can start."""
        ch, i = self.slot[key]
        (self.send_at if send else self.recv_at)[ch][i] = t
        msgs = self.messages[ch]
        while self.head[ch] < len(msgs):
            i = self.head[ch]
            s_t, r_t = self.send_at[ch][i], self.recv_at[ch][i]
            if s_t is None or r_t is None:
                return
            key, recv = msgs[i]
            d = self.durations.get(recv.kind)
            if d is None:
                d = self.durations[recv.kind] = self.transfer_time(recv)
            start = max(s_t, r_t, self.free_at[ch])
            self.free_at[ch] = start + d
            src, dst = self.ends[ch]
            send_kind = "SEND_F" if recv.kind is Kind.RECV_F else "SEND_B"
            spans.append(Span(src, "comm", send_kind, recv.stage, recv.mb, start, d, None, dst))
            spans.append(Span(dst, "comm", recv.kind.value, recv.stage, recv.mb, start, d, None, src))
            heapq.heappush(self.arrivals, (start + d, len(spans), key))
            self.head[ch] = i + 1

    def next_arrival(self) -> float:
        return self.arrivals[0][0] if self.arrivals else math.inf

    def deliver(self, t: float, done: dict[tuple, float]) -> None:
        """Every message that has arrived by t is there for its receiver."""
        while self.arrivals and self.arrivals[0][0] <= t:
            _, _, key = heapq.heappop(self.arrivals)
            done[key] = t


class _CoreScheduler:
    """Which ranks hold a core (slice_us > 0), the way Linux's scheduler hands them on (see the module docstring).
    `rates` is the progress rate of each running rank, fluid (slice_us = 0) or scheduled."""

    def __init__(self, cores: Sequence[float], slice_us: float, protect_us: float):
        self.cap = capacity(cores)
        self.slice_us, self.protect_us = slice_us, protect_us
        self.slots = max(1, round(max(float(c) for c in cores)))
        self.on_core: dict[int, float] = {}  # rank -> when its protection ends
        self.waiting: deque[int] = deque()  # ranks that want a core and have none
        self.switching: dict[int, float] = {}  # rank -> what is left of the time it loses getting a core back
        self.woke_a_peer: set[int] = set()  # ranks that just posted a message to a rank waiting for one

    def switch_cost(self, k: int) -> float:
        """Time a rank loses when it takes a core from another, with k ranks wanting one: what makes k > slots
        always-ready ranks progress at cores(k) in total rather than cores(slots), with min(k - slots, slots)
        switches per tick."""
        if k <= self.slots:
            return 0.0
        return self.slice_us * self.slots * max(0.0, 1.0 - self.cap(k) / self.cap(self.slots)) / \
            min(k - self.slots, self.slots)

    def rates(self, running: dict[int, _Running]) -> dict[int, float]:
        k = len(running)
        if not k:
            return {}
        if not self.slice_us:
            return dict.fromkeys(running, min(1.0, self.cap(k) / k))
        m = min(k, self.slots)
        speed = min(1.0, self.cap(m) / m)
        return {r: speed if r in self.on_core and r not in self.switching else 0.0 for r in running}

    def next_event(self, t: float) -> float:
        """The next time the cores change hands by themselves: a tick after a protection's end, or a switch's end."""
        t_next = math.inf
        if self.waiting and self.on_core:
            t_next = self._next_tick(t, max(t, min(self.on_core.values())))
        for left in self.switching.values():
            t_next = min(t_next, t + left)
        return t_next

    def elapse(self, dt: float) -> None:
        for r in list(self.switching):
            self.switching[r] -= dt
            if self.switching[r] <= 1e-9 * max(1.0, self.slice_us):
                del self.switching[r]

    def _at_tick(self, t: float) -> bool:
        return abs(t - round(t / self.slice_us) * self.slice_us) <= 1e-9 * max(1.0, t)

    def _next_tick(self, t: float, after: float) -> float:
        """The first tick at or after `after` that is later than t."""
        tick = math.ceil(after / self.slice_us - 1e-9) * self.slice_us
        return tick + self.slice_us if tick <= t + 1e-9 * max(1.0, t) else tick

    def _preempt(self, r: int) -> None:
        """r loses its core and gets in line for one."""
        del self.on_core[r]
        self.switching.pop(r, None)
        self.waiting.append(r)

    def give_cores(self, t: float, running: dict[int, _Running], woken: list[int]) -> None:
        """Hand the cores on: ranks that woke up go first in line; a rank past its protection gives its core up
        when it woke a waiting peer, or at a tick when someone waits."""
        for r in [r for r in self.on_core if r not in running]:  # waits for a message: the core is free
            del self.on_core[r]
            self.switching.pop(r, None)
        self.waiting.extendleft(reversed(woken))
        for r in sorted(self.woke_a_peer & set(self.on_core), key=lambda r: self.on_core[r]):
            if self.on_core[r] <= t:
                self._preempt(r)
        self.woke_a_peer.clear()
        want = len(self.waiting) - (self.slots - len(self.on_core))
        if want > 0 and self._at_tick(t):
            past = sorted([r for r, until in self.on_core.items() if until <= t], key=lambda r: self.on_core[r])
            for r in past[:want]:
                self._preempt(r)
        lost = self.switch_cost(len(running))
        while self.waiting and len(self.on_core) < self.slots:
            r = self.waiting.popleft()
            self.on_core[r] = t + lost + self.protect_us
            if lost > 0:
                self.switching[r] = lost


class _SharedCoresRun:
    """One simulation: the ranks' programs walked as events (an action starts or ends, a message arrives, the
    cores change hands), with the channels and the core scheduler as collaborators."""

    def __init__(self, lowered: Schedule, work: Callable[[Action], float], channels: _Channels,
                 cpu: _CoreScheduler, gap_us: float, fb_forward_share: Callable[[Action], float] | None):
        self.topo = Topology(lowered)
        self.programs = lowered.actions
        self.P = lowered.num_ranks
        self.work, self.channels, self.cpu = work, channels, cpu
        self.gap_us, self.fb_forward_share = gap_us, fb_forward_share
        self.done: dict[tuple, float] = {}
        self.ptr = [0] * self.P
        self.running: dict[int, _Running] = {}
        self.paused: dict[int, _Running] = {}  # F&B pairs between their halves, waiting for the backward's input
        self.preposted: set[tuple[int, int]] = set()  # (rank, program index) of sends posted by their pair's half
        self.spans: list[Span] = []
        self.busy = [0.0] * self.P
        self.end = [0.0] * self.P
        self.t = 0.0

    # -- a rank's program --------------------------------------------------------------------------------------
    def _half_needs(self, a: Action, r: int, forward: bool) -> list:
        half = Action(Kind.F, a.stage, a.mb) if forward else Action(Kind.B, a.b_stage, a.b_mb)
        return needs(half, r, self.topo)

    def _post_send(self, r: int, a: Action) -> None:
        if a.peer not in self.running:
            self.cpu.woke_a_peer.add(r)
        self.channels.post((_SEND[a.kind][0], a.stage, a.mb), self.t, True, self.spans)

    def _forward_half_done(self, r: int, run: _Running) -> None:
        """An F&B pair's forward half ended: its output exists and its send goes out (it follows the pair)."""
        a = run.action
        run.mid = None
        self.done[("F", a.stage, a.mb)] = self.t
        acts = self.programs[r]
        for j in range(self.ptr[r], len(acts)):
            s_ = acts[j]
            if s_.kind not in COMM_KINDS:
                break
            if s_.kind is Kind.SEND_F and (s_.stage, s_.mb) == (a.stage, a.mb):
                self._post_send(r, s_)
                self.preposted.add((r, j))
                break

    def advance(self, r: int) -> None:
        """Run rank r's posts at the current time up to its next compute action; take that up when its inputs
        exist."""
        acts, done = self.programs[r], self.done
        while self.ptr[r] < len(acts):
            a = acts[self.ptr[r]]
            if a.kind in (Kind.RECV_F, Kind.RECV_B):
                self.channels.post(produces(a)[0], self.t, False, self.spans)
            elif a.kind in _SEND:
                if (r, self.ptr[r]) not in self.preposted:
                    if any(k not in done for k in needs(a, r, self.topo)):
                        return
                    self._post_send(r, a)
            else:
                split = a.kind is Kind.FB and self.fb_forward_share is not None
                # a pair whose halves run in turn starts with its forward's input (the backward's comes later)
                if any(k not in done for k in (self._half_needs(a, r, True) if split else needs(a, r, self.topo))):
                    return
                w = float(self.work(a))
                mid = w * (1.0 - self.fb_forward_share(a)) if split else None
                self.running[r] = _Running(a, self.gap_us, w, self.t, mid=mid)
                self.ptr[r] += 1
                return
            self.ptr[r] += 1

    # -- the event loop ----------------------------------------------------------------------------------------
    def _next_event(self, rate: dict[int, float]) -> float:
        t = self.t
        t_next = min(self.channels.next_arrival(), self.cpu.next_event(t))
        for r, run in self.running.items():
            if run.started is None and run.gap_left <= 1e-9 * max(1.0, self.gap_us) and rate[r] > 0:
                run.started = t  # no gap left: the span starts when the rank progresses
            if rate[r] > 0:
                left = run.gap_left if run.started is None else run.work_left - (run.mid or 0.0)
                t_next = min(t_next, t + left / rate[r])
        if math.isinf(t_next):
            raise RuntimeError("shared-cores simulation stalled: no rank can progress (cores(k) must be > 0)")
        return t_next

    def _progress(self, dt: float, rate: dict[int, float]) -> tuple[list[int], list[int]]:
        """Every running rank progresses for dt; returns (ranks whose action ended, ranks whose F&B pair's forward
        half ended)."""
        t, finished, halved = self.t, [], []
        for r, run in self.running.items():
            progress = dt * rate[r]
            if run.started is None:
                run.gap_left -= progress
                if run.gap_left <= 1e-9 * max(1.0, self.gap_us) and progress > 0:
                    run.started = t
            else:
                run.work_left -= progress
                if run.mid is not None and run.work_left - run.mid <= 1e-9 * max(1.0, t - run.started):
                    halved.append(r)
                elif run.work_left <= 1e-9 * max(1.0, t - run.started):
                    finished.append(r)
        return finished, halved

    def _finish(self, finished: list[int], halved: list[int]) -> None:
        t = self.t
        for r in finished:
            run = self.running.pop(r)
            a = run.action
            partner = (a.b_stage, a.b_mb) if a.kind is Kind.FB else None
            self.spans.append(Span(r, "compute", a.kind.value, a.stage, a.mb, run.started, t - run.started, partner))
            self.busy[r] += t - run.posted
            self.end[r] = t
            for k in produces(a):
                self.done[k] = t
        for r in halved:  # the forward half ended: its output is sent; the backward half needs its own input
            run = self.running[r]
            self._forward_half_done(r, run)
            if any(k not in self.done for k in self._half_needs(run.action, r, False)):
                self.paused[r] = self.running.pop(r)
                self.busy[r] += t - run.posted

    def _take_up(self) -> list[int]:
        """Ranks take up their next action where its inputs exist; returns those that need a core for it."""
        woken = []
        for r in range(self.P):
            if r in self.paused:
                if all(k in self.done for k in self._half_needs(self.paused[r].action, r, False)):
                    self.running[r] = self.paused.pop(r)
                    self.running[r].posted = self.t
                    if r not in self.cpu.on_core:
                        woken.append(r)
            elif r not in self.running:
                self.advance(r)  # a rank that finished keeps its core when its next action is ready
                if r in self.running and r not in self.cpu.on_core:
                    woken.append(r)
        return woken

    def run(self) -> None:
        scheduled = bool(self.cpu.slice_us)
        for r in range(self.P):
            self.advance(r)
        if scheduled:
            self.cpu.give_cores(self.t, self.running, sorted(self.running))
        while self.running or self.channels.arrivals or self.paused:
            rate = self.cpu.rates(self.running)
            t_next = self._next_event(rate)
            dt, self.t = t_next - self.t, t_next
            self.cpu.elapse(dt)
            self._finish(*self._progress(dt, rate))
            self.channels.deliver(self.t, self.done)
            woken = self._take_up()
            if scheduled:
                self.cpu.give_cores(self.t, self.running, woken)

    def blocked(self) -> dict[int, Action]:
        return {r: self.programs[r][self.ptr[r]] for r in range(self.P) if self.ptr[r] < len(self.programs[r])}


def simulate_shared(schedule: Schedule, work: Callable[[Action], float], transfer_time: Callable[[Action], float],
                    cores: Sequence[float], gap_us: float = 0.0, time_unit: str = "us",
                    slice_us: float = 0.0, protect_us: float = 0.0,
                    fb_forward_share: Callable[[Action], float] | None = None) -> SimResult:
    """Simulate `schedule` on ranks sharing cores (see the module docstring). `work(a)`: full-speed time of a
    compute action; `transfer_time(a)`: duration of a message, called with its RECV action (peer = sender);
    `gap_us`: full-speed executor work before every compute action; `slice_us`: the OS time slice, i.e. the
    scheduler tick (0: fluid sharing, else ranks scheduled on cores, preempted at ticks); `protect_us`: how long
    a rank that takes a core runs before a tick may preempt it. Busy time per rank counts gaps and waits for a
    core. `fb_forward_share(a)`: the share of an F&B pair's work that is its forward half, which the runtime runs
    first and whose output it sends as soon as it exists (pipeline.runtime.executor); None: the pair publishes both
    outputs at its end."""
    lowered = check_structure(schedule)
    cpu = _CoreScheduler(cores, slice_us, protect_us)  # checks cores
    if slice_us < 0 or protect_us < 0:
        raise ValueError(f"slice_us and protect_us must be >= 0, got {slice_us}, {protect_us}")
    sim = _SharedCoresRun(lowered, work, _Channels(lowered.actions, transfer_time), cpu, gap_us, fb_forward_share)
    sim.run()
    blocked = sim.blocked()
    if blocked:
        raise_deadlock(lowered, blocked)
    meta = {"source": "simulated", "time_unit": time_unit, "pipelines": [list(p) for p in schedule.pipelines],
            "schedule": trace_meta(schedule.kind, schedule.num_ranks, schedule.num_microbatches),
            "cores_by_concurrency": [float(c) for c in cores], "time_slice_us": float(slice_us),
            "protect_us": float(protect_us)}
    makespan = max(sim.end, default=0.0)
    busy = dict(enumerate(sim.busy))
    return SimResult(Trace(spans=sim.spans, meta=meta), makespan, busy,
                     {r: makespan - b for r, b in busy.items()}, peak_live_activations(schedule))
