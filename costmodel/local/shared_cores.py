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
    topo = Topology(lowered)
    cap = capacity(cores)
    if slice_us < 0 or protect_us < 0:
        raise ValueError(f"slice_us and protect_us must be >= 0, got {slice_us}, {protect_us}")
    P = lowered.num_ranks
    programs = lowered.actions

    channel_of: dict[tuple[int, int], int] = {}
    messages: list[list[tuple[tuple, Action]]] = []  # per channel: (delivered key, RECV action) in send order
    slot: dict[tuple, tuple[int, int]] = {}
    for src, acts in enumerate(programs):
        for a in acts:
            if a.kind in _SEND:
                ch = channel_of.setdefault((src, a.peer), len(messages))
                if ch == len(messages):
                    messages.append([])
                tag, recv_kind = _SEND[a.kind]
                key = (tag, a.stage, a.mb)
                slot[key] = (ch, len(messages[ch]))
                messages[ch].append((key, Action(recv_kind, a.stage, a.mb, -1, -1, src)))
    send_at = [[None] * len(m) for m in messages]
    recv_at = [[None] * len(m) for m in messages]
    head = [0] * len(messages)
    channel_free = [0.0] * len(messages)
    channel_ends = {ch: ends for ends, ch in channel_of.items()}
    transfer_cache: dict[Kind, float] = {}
    arrivals: list[tuple[float, int, tuple]] = []  # (time, tie-break, delivered key)

    done: dict[tuple, float] = {}
    ptr = [0] * P
    running: dict[int, _Running] = {}
    spans: list[Span] = []
    busy = [0.0] * P
    end = [0.0] * P
    t = 0.0

    slots = max(1, round(max(float(c) for c in cores)))
    on_core: dict[int, float] = {}  # rank -> when its protection ends (slice_us > 0)
    waiting: deque[int] = deque()  # ranks that want a core and have none
    switching: dict[int, float] = {}  # rank -> what is left of the time it loses getting a core back
    woke_a_peer: set[int] = set()  # ranks that just posted a message to a rank waiting for one
    preposted: set[tuple[int, int]] = set()  # (rank, program index) of sends posted by the half that produced them
    paused: dict[int, _Running] = {}  # F&B pairs between their halves, waiting for the backward half's input

    def half_needs(a: Action, r: int, forward: bool) -> list:
        half = Action(Kind.F, a.stage, a.mb) if forward else Action(Kind.B, a.b_stage, a.b_mb)
        return needs(half, r, topo)

    def post_send(r: int, a: Action) -> None:
        ch, i = slot[(_SEND[a.kind][0], a.stage, a.mb)]
        send_at[ch][i] = t
        if a.peer not in running:
            woke_a_peer.add(r)
        resolve(ch)

    def forward_half_done(r: int, run: _Running) -> None:
        """An F&B pair's forward half ended: its output exists and its send goes out (it follows the pair)."""
        a = run.action
        run.mid = None
        done[("F", a.stage, a.mb)] = t
        acts = programs[r]
        for j in range(ptr[r], len(acts)):
            s_ = acts[j]
            if s_.kind not in COMM_KINDS:
                break
            if s_.kind is Kind.SEND_F and (s_.stage, s_.mb) == (a.stage, a.mb):
                post_send(r, s_)
                preposted.add((r, j))
                break

    def switch_cost(k: int) -> float:
        """Time a rank loses when it takes a core from another, with k ranks wanting one: what makes k > slots
        always-ready ranks progress at cores(k) in total rather than cores(slots), with min(k - slots, slots)
        switches per tick."""
        if k <= slots:
            return 0.0
        return slice_us * slots * max(0.0, 1.0 - cap(k) / cap(slots)) / min(k - slots, slots)

    def rates() -> dict[int, float]:
        """Progress rate per running rank (see the module docstring)."""
        k = len(running)
        if not k:
            return {}
        if not slice_us:
            return dict.fromkeys(running, min(1.0, cap(k) / k))
        speed = min(1.0, cap(min(k, slots)) / min(k, slots))
        return {r: speed if r in on_core and r not in switching else 0.0 for r in running}

    def at_tick() -> bool:
        return abs(t - round(t / slice_us) * slice_us) <= 1e-9 * max(1.0, t)

    def next_tick(after: float) -> float:
        """The first tick at or after `after` that is later than now."""
        tick = math.ceil(after / slice_us - 1e-9) * slice_us
        return tick + slice_us if tick <= t + 1e-9 * max(1.0, t) else tick

    def preempt(r: int) -> None:
        """r loses its core and gets in line for one."""
        del on_core[r]
        switching.pop(r, None)
        waiting.append(r)

    def give_cores(woken: list[int]) -> None:
        """Hand the cores on (see the module docstring): ranks that woke up go first in line; a rank past its
        protection gives its core up when it woke a waiting peer, or at a tick when someone waits."""
        for r in [r for r in on_core if r not in running]:  # waits for a message: the core is free
            del on_core[r]
            switching.pop(r, None)
        waiting.extendleft(reversed(woken))
        for r in sorted(woke_a_peer & set(on_core), key=lambda r: on_core[r]):
            if on_core[r] <= t:
                preempt(r)
        woke_a_peer.clear()
        want = len(waiting) - (slots - len(on_core))
        if want > 0 and at_tick():
            for r in sorted([r for r, until in on_core.items() if until <= t], key=lambda r: on_core[r])[:want]:
                preempt(r)
        lost = switch_cost(len(running))
        while waiting and len(on_core) < slots:
            r = waiting.popleft()
            on_core[r] = t + lost + protect_us
            if lost > 0:
                switching[r] = lost

    def resolve(ch: int) -> None:
        msgs = messages[ch]
        while head[ch] < len(msgs):
            i = head[ch]
            s_t, r_t = send_at[ch][i], recv_at[ch][i]
            if s_t is None or r_t is None:
                return
            key, recv = msgs[i]
            d = transfer_cache.get(recv.kind)
            if d is None:
                d = transfer_cache[recv.kind] = transfer_time(recv)
            start = max(s_t, r_t, channel_free[ch])
            channel_free[ch] = start + d
            src, dst = channel_ends[ch]
            send_kind = "SEND_F" if recv.kind is Kind.RECV_F else "SEND_B"
            spans.append(Span(src, "comm", send_kind, recv.stage, recv.mb, start, d, None, dst))
            spans.append(Span(dst, "comm", recv.kind.value, recv.stage, recv.mb, start, d, None, src))
            heapq.heappush(arrivals, (start + d, len(spans), key))
            head[ch] = i + 1

    def advance(r: int) -> None:
        """Run rank r's posts at time t up to its next compute action; take that up when its inputs exist."""
        acts = programs[r]
        while ptr[r] < len(acts):
            a = acts[ptr[r]]
            if a.kind in (Kind.RECV_F, Kind.RECV_B):
                ch, i = slot[produces(a)[0]]
                recv_at[ch][i] = t
                resolve(ch)
            elif a.kind in _SEND:
                if (r, ptr[r]) not in preposted:
                    if any(k not in done for k in needs(a, r, topo)):
                        return
                    post_send(r, a)
            else:
                split = a.kind is Kind.FB and fb_forward_share is not None
                # a pair whose halves run in turn starts with its forward's input (the backward's comes later)
                if any(k not in done for k in (half_needs(a, r, True) if split else needs(a, r, topo))):
                    return
                w = float(work(a))
                mid = w * (1.0 - fb_forward_share(a)) if split else None
                running[r] = _Running(a, gap_us, w, t, mid=mid)
                ptr[r] += 1
                return
            ptr[r] += 1

    for r in range(P):
        advance(r)
    if slice_us:
        give_cores(sorted(running))
    while running or arrivals or paused:
        rate = rates()
        t_next = arrivals[0][0] if arrivals else math.inf
        if waiting and on_core:  # the first tick after a protection's end hands a core on
            t_next = min(t_next, next_tick(max(t, min(on_core.values()))))
        for left in switching.values():
            t_next = min(t_next, t + left)
        for r, run in running.items():
            if run.started is None and run.gap_left <= 1e-9 * max(1.0, gap_us) and rate[r] > 0:
                run.started = t  # no gap left: the span starts when the rank progresses
            if rate[r] > 0:
                left = run.gap_left if run.started is None else run.work_left - (run.mid or 0.0)
                t_next = min(t_next, t + left / rate[r])
        if math.isinf(t_next):
            raise RuntimeError("shared-cores simulation stalled: no rank can progress (cores(k) must be > 0)")
        dt = t_next - t
        t = t_next
        finished, halved = [], []
        for r in list(switching):
            switching[r] -= dt
            if switching[r] <= 1e-9 * max(1.0, slice_us):
                del switching[r]
        for r, run in running.items():
            progress = dt * rate[r]
            if run.started is None:
                run.gap_left -= progress
                if run.gap_left <= 1e-9 * max(1.0, gap_us) and progress > 0:
                    run.started = t
            else:
                run.work_left -= progress
                if run.mid is not None and run.work_left - run.mid <= 1e-9 * max(1.0, t - run.started):
                    halved.append(r)
                elif run.work_left <= 1e-9 * max(1.0, t - run.started):
                    finished.append(r)
        for r in finished:
            run = running.pop(r)
            a = run.action
            partner = (a.b_stage, a.b_mb) if a.kind is Kind.FB else None
            spans.append(Span(r, "compute", a.kind.value, a.stage, a.mb, run.started, t - run.started, partner))
            busy[r] += t - run.posted
            end[r] = t
            for k in produces(a):
                done[k] = t
        for r in halved:  # the forward half ended: its output is sent; the backward half needs its own input
            run = running[r]
            forward_half_done(r, run)
            if any(k not in done for k in half_needs(run.action, r, False)):
                paused[r] = running.pop(r)
                busy[r] += t - run.posted
        while arrivals and arrivals[0][0] <= t:
            _, _, key = heapq.heappop(arrivals)
            done[key] = t
        woken = []
        for r in range(P):
            if r in paused:
                if all(k in done for k in half_needs(paused[r].action, r, False)):
                    running[r] = paused.pop(r)
                    running[r].posted = t
                    if r not in on_core:
                        woken.append(r)
            elif r not in running:
                advance(r)  # a rank that finished keeps its core when its next action is ready
                if r in running and r not in on_core:
                    woken.append(r)
        if slice_us:
            give_cores(woken)
    blocked = {r: programs[r][ptr[r]] for r in range(P) if ptr[r] < len(programs[r])}
    if blocked:
        raise_deadlock(lowered, blocked)
    meta = {"source": "simulated", "time_unit": time_unit, "pipelines": [list(p) for p in schedule.pipelines],
            "schedule": {"kind": schedule.kind, "ranks": schedule.num_ranks,
                         "microbatches": schedule.num_microbatches},
            "cores_by_concurrency": [float(c) for c in cores], "time_slice_us": float(slice_us),
            "protect_us": float(protect_us)}
    makespan = max(end, default=0.0)
    busy_d = dict(enumerate(busy))
    return SimResult(Trace(spans=spans, meta=meta), makespan, busy_d,
                     {r: makespan - b for r, b in busy_d.items()}, peak_live_activations(schedule))
