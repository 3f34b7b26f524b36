"""Discrete-event simulation of a schedule: actions + durations -> a `traces.Trace`.

Semantics (the same as the runtime's, and as `graph.py` states them as edges): each rank runs its compute
actions in program order on one compute stream; SEND/RECV are non-blocking posts made when the rank reaches
them (after the preceding compute finished); a transfer starts when both sides have posted, its producer has
finished and the previous message on its channel (src rank -> dst rank, FIFO) is through; a compute action
waits only for the tensors it consumes.

The engine walks every rank's program with a pointer and parks a rank on the first missing input, so each
action is handled once: 10^5-10^6 actions simulate in about a second.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable

from schedules.durations import Durations
from schedules.ir import Action, Kind, Schedule
from traces.trace import Span, Trace

_SEND_TO_RECV = {Kind.SEND_F: Kind.RECV_F, Kind.SEND_B: Kind.RECV_B}
_COMPUTE_KINDS = frozenset({Kind.F, Kind.I, Kind.W, Kind.B, Kind.FB})


@dataclass
class EngineResult:
    completed: bool
    spans: list[Span]
    blocked: dict[int, Action] = field(default_factory=dict)  # rank -> action it is stuck at


_KEY_CODES = {"F": 0, "G": 1, "I": 2, "XF": 3, "XG": 4}
_OP_COMPUTE, _OP_SEND, _OP_RECV = 0, 1, 2


def _compile(schedule: Schedule, compute_time: Callable[[Action], float]):
    """Per rank, a list of integer-keyed ops. The keys of deps.py become ids code*S*C + stage*C + mb; the
    per-stage need offsets below are deps.needs/produces specialised to one schedule (tests check they agree)."""
    S, C = schedule.num_stages, max(1, schedule.microbatches_per_pipeline)
    SC = S * C
    where = schedule.stage_to_rank
    prev, nxt = schedule.prev_stage(), schedule.next_stage()
    F_, G_, I_, XF_, XG_ = (code * SC for code in range(5))
    # offset + mb = the key a forward (resp. backward) of this stage waits for; -1: nothing to wait for
    f_need = [-1] * S
    b_need = [-1] * S
    for st in range(S):
        p, n = prev.get(st), nxt.get(st)
        if p is not None:
            f_need[st] = (F_ if where[p] == where[st] else XF_) + p * C
        if n is not None:
            b_need[st] = (G_ if where[n] == where[st] else XG_) + n * C

    channels: dict[tuple[int, int], list[Action]] = defaultdict(list)
    for src, acts in enumerate(schedule.actions):
        for a in acts:
            recv_kind = _SEND_TO_RECV.get(a.kind)
            if recv_kind is not None:
                channels[(src, a.peer)].append(Action(recv_kind, a.stage, a.mb, -1, -1, src))
    channel_list = list(channels)
    channel_id = {ch: i for i, ch in enumerate(channel_list)}
    slot = [{m: i for i, m in enumerate(channels[ch])} for ch in channel_list]
    durations: dict[tuple, float] = {}
    KF, KI, KW, KB, KFB, KSF, KSB = Kind.F, Kind.I, Kind.W, Kind.B, Kind.FB, Kind.SEND_F, Kind.SEND_B
    programs = []
    for r, acts in enumerate(schedule.actions):
        ops = []
        append = ops.append
        for a in acts:
            kind, st, mb = a.kind, a.stage, a.mb
            if kind is KF or kind is KI or kind is KB or kind is KW or kind is KFB:
                cost_key = (kind, st, a.b_stage)
                d = durations.get(cost_key)
                if d is None:
                    d = durations[cost_key] = compute_time(a)
                k = st * C + mb
                if kind is KF:
                    need = (f_need[st] + mb,) if f_need[st] >= 0 else ()
                    made = (F_ + k,)
                elif kind is KW:
                    need, made = (I_ + k,), ()
                elif kind is KFB:
                    bs, bm = a.b_stage, a.b_mb
                    need = ((f_need[st] + mb,) if f_need[st] >= 0 else ()) + (F_ + bs * C + bm,) + \
                        ((b_need[bs] + bm,) if b_need[bs] >= 0 else ())
                    made = (F_ + k, G_ + bs * C + bm)
                else:
                    need = (F_ + k, b_need[st] + mb) if b_need[st] >= 0 else (F_ + k,)
                    made = (G_ + k, I_ + k) if kind is KI else (G_ + k,)
                append((_OP_COMPUTE, d, need, made, a))
            elif kind is KSF or kind is KSB:
                ch = channel_id[(r, a.peer)]
                recv = Action(Kind.RECV_F if kind is KSF else Kind.RECV_B, st, mb, -1, -1, r)
                append((_OP_SEND, (F_ if kind is KSF else G_) + st * C + mb, ch, slot[ch][recv], a))
            else:
                ch = channel_id.get((a.peer, r))
                index = None if ch is None else slot[ch].get(a)
                append((_OP_RECV, ch, index, 0, a))
        programs.append(ops)
    messages = [channels[ch] for ch in channel_list]
    message_keys = [[(XF_ if m.kind is Kind.RECV_F else XG_) + m.stage * C + m.mb for m in msgs] for msgs in messages]
    return programs, channel_list, messages, message_keys, 5 * SC


def run_engine(schedule: Schedule, compute_time: Callable[[Action], float],
               transfer_time: Callable[[Action], float], record: bool = True) -> EngineResult:
    """Execute a lowered schedule. Returns spans (when `record`) or the actions ranks are stuck at."""
    programs, channel_list, messages, message_keys, num_keys = _compile(schedule, compute_time)
    P = schedule.num_ranks
    send_ready = [[None] * len(m) for m in messages]
    recv_post = [[None] * len(m) for m in messages]
    chan_next = [0] * len(messages)
    chan_end = [0.0] * len(messages)
    transfer_cache: dict[Kind, float] = {}

    done: list[float | None] = [None] * num_keys
    waiters: dict[int, list[int]] = {}
    ptr = [0] * P
    free = [0.0] * P
    ready = deque(range(P))
    queued = [True] * P
    spans: list[Span] = []

    def finish(key: int, t: float) -> None:
        done[key] = t
        parked = waiters.pop(key, None)
        if parked:
            for r in parked:
                if not queued[r]:
                    queued[r] = True
                    ready.append(r)

    def resolve(ch: int) -> None:
        msgs, keys, sr, rp = messages[ch], message_keys[ch], send_ready[ch], recv_post[ch]
        i, prev_end, n = chan_next[ch], chan_end[ch], len(msgs)
        while i < n and sr[i] is not None and rp[i] is not None:
            m = msgs[i]
            start = max(sr[i], rp[i], prev_end)
            d = transfer_cache.get(m.kind)
            if d is None:
                d = transfer_cache[m.kind] = transfer_time(m)
            prev_end = start + d
            if record:
                src, dst = channel_list[ch]
                send_kind = "SEND_F" if m.kind is Kind.RECV_F else "SEND_B"
                spans.append(Span(src, "comm", send_kind, m.stage, m.mb, start, d, peer=dst))
                spans.append(Span(dst, "comm", m.kind.value, m.stage, m.mb, start, d, peer=src))
            finish(keys[i], prev_end)
            i += 1
        chan_next[ch], chan_end[ch] = i, prev_end

    while ready:
        r = ready.popleft()
        queued[r] = False
        ops = programs[r]
        i = ptr[r]
        n = len(ops)
        t_free = free[r]
        while i < n:
            op = ops[i]
            code = op[0]
            if code == _OP_COMPUTE:
                t = t_free
                missing = -1
                for key in op[2]:
                    v = done[key]
                    if v is None:
                        missing = key
                        break
                    if v > t:
                        t = v
                if missing >= 0:
                    waiters.setdefault(missing, []).append(r)
                    break
                t_free = t + op[1]
                if record:
                    a = op[4]
                    partner = (a.b_stage, a.b_mb) if a.kind is Kind.FB else None
                    spans.append(Span(r, "compute", a.kind.value, a.stage, a.mb, t, op[1], partner=partner))
                for key in op[3]:
                    finish(key, t_free)
            elif code == _OP_SEND:
                v = done[op[1]]
                if v is None:
                    waiters.setdefault(op[1], []).append(r)
                    break
                send_ready[op[2]][op[3]] = v if v > t_free else t_free
                resolve(op[2])
            else:
                if op[2] is None:
                    free[r], ptr[r] = t_free, i
                    return EngineResult(False, spans, {r: op[4]})
                recv_post[op[1]][op[2]] = t_free
                resolve(op[1])
            i += 1
        ptr[r] = i
        free[r] = t_free

    blocked = {r: programs[r][ptr[r]][4] for r in range(P) if ptr[r] < len(programs[r])}
    return EngineResult(not blocked, spans, blocked)


@dataclass
class SimResult:
    """What `simulate` reports: the predicted trace and the schedule's headline numbers."""

    trace: Trace
    makespan: float
    busy: dict[int, float]
    idle: dict[int, float]
    peak_activations: dict[int, int]

    @property
    def bubble_fraction(self) -> float:
        total = self.makespan * len(self.idle)
        return sum(self.idle.values()) / total if total else 0.0

    def summary(self) -> str:
        lines = [f"makespan {self.makespan:g}, bubble {100 * self.bubble_fraction:.1f}% of rank-time",
                 "rank  busy      idle      peak live activations (chunks)"]
        for r in sorted(self.idle):
            lines.append(f"{r:>4}  {self.busy[r]:<8g}  {self.idle[r]:<8g}  {self.peak_activations[r]}")
        return "\n".join(lines)


def peak_live_activations(schedule: Schedule) -> dict[int, int]:
    """Per rank, the most chunk activations alive at once in program order: alive from the start of a chunk's F
    to the end of its B or I (an overlapped F&B holds its forward's activation before freeing the backward's)."""
    peaks = {}
    for r, acts in enumerate(schedule.actions):
        live = peak = 0
        for a in acts:
            for part in a.parts():
                if part.kind is Kind.F:
                    live += 1
                    peak = max(peak, live)
                elif part.kind in (Kind.I, Kind.B):
                    live -= 1
        peaks[r] = peak
    return peaks


def simulate(schedule: Schedule, durations: Durations | None = None, *,
             compute_time: Callable[[Action], float] | None = None,
             transfer_time: Callable[[Action], float] | None = None,
             validate: bool = True, time_unit: str = "us") -> SimResult:
    """Simulate `schedule` (lowered here if it is compute-only) and return its predicted trace and numbers.

    `durations` prices actions by kind (default: unit costs, B = I + W, FB = F + B, free P2P);
    `compute_time`/`transfer_time` override it per action (the cost model passes its own).
    """
    from schedules.lowering import lower_comms
    from schedules.validate import check_structure, raise_deadlock

    durations = durations or Durations()
    lowered = check_structure(schedule) if validate else (schedule if schedule.lowered else lower_comms(schedule))
    result = run_engine(lowered, compute_time or durations.compute, transfer_time or durations.transfer)
    if not result.completed:
        raise_deadlock(lowered, result.blocked)
    meta = {"source": "simulated", "time_unit": time_unit, "pipelines": [list(p) for p in schedule.pipelines],
            "schedule": {"kind": schedule.kind, "ranks": schedule.num_ranks,
                         "microbatches": schedule.num_microbatches}}
    trace = Trace(spans=result.spans, meta=meta)
    busy = trace.busy("compute")
    makespan = trace.makespan()
    idle = {r: makespan - busy.get(r, 0.0) for r in range(schedule.num_ranks)}
    busy = {r: busy.get(r, 0.0) for r in range(schedule.num_ranks)}
    return SimResult(trace, makespan, busy, idle, peak_live_activations(schedule))
