"""The event engine under `schedules.simulate` and `schedules.validate`: execute a lowered schedule with given
action costs and report its spans, or the actions where ranks got stuck (a deadlock).

Semantics (as `graph.py` states them as edges): each rank runs its compute actions in program order on one
compute stream; SEND/RECV are non-blocking posts made when the rank reaches them (after the preceding compute
finished); a transfer starts when both sides have posted, its producer has finished and the previous message on
its channel (src rank -> dst rank, FIFO) is through; a compute action waits only for the tensors it consumes.

P2P semantics (`p2p`, costmodel.md §2.6): "commit" is the above (sends posted at their program point, as
DualPipe's reference commits them; validation uses it, it is the conservative rule for deadlocks); "rendezvous"
posts a send when its tensor is produced (this runtime: pipeline/runtime/executor.py), so an F&B pair's forward output
leaves while its backward half still computes; "dataflow" also treats every receive as posted from the start (a
transfer starts when its tensor exists: the lower bound).

F&B pairs: with `fb_timing(action, lag_f, lag_b) -> (duration, forward output ready, input gradient ready)` a
pair starts when the rank is free and either half's input is there, its halves' inputs arriving lag_f / lag_b
later, and publishes each output when it is ready rather than at the pair's end (costmodel.pricing.fb_overlap prices
that).
Without it a pair waits for both inputs and publishes both outputs at its end.

The engine walks every rank's program with a pointer and parks a rank on the first missing input, so each
action is handled once: 10^5-10^6 actions simulate in about a second. A schedule rerun without spans replays the
order a completed run handled its actions in (schedules.replay), without the parking and waking.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from schedules.ir import Action, Kind, Schedule
from schedules.memo import derived
from traces.trace import Span, collector_paused

P2P_MODES = ("rendezvous", "commit", "dataflow")


@dataclass
class EngineResult:
    completed: bool
    spans: list[Span]
    blocked: dict[int, Action] = field(default_factory=dict)  # rank -> action it is stuck at
    busy: list[float] = field(default_factory=list)  # per rank, summed compute durations
    end: list[float] = field(default_factory=list)  # per rank, end of its last compute action
    # per stage, the end of the last action writing its gradients (W, I, B, an F&B's B half; None: none), kept
    # also without spans: the gradient all-reduce starts from it (costmodel.pricing.data_parallel)
    grad_done: list[float | None] = field(default_factory=list)


def _stage_needs(schedule: Schedule, C: int, F_: int, G_: int, XF_: int, XG_: int) -> tuple[list[int], list[int]]:
    """Per stage, the key offset (+ mb) its forward waits for and the one its backward waits for besides its own
    forward: the neighbour stage's output, on this rank (F_, G_) or delivered from another (XF_, XG_); -1: none."""
    S = schedule.num_stages
    where = schedule.stage_to_rank
    prev, nxt = schedule.prev_stage(), schedule.next_stage()
    f_need, b_need = [-1] * S, [-1] * S
    for st in range(S):
        p, n = prev.get(st), nxt.get(st)
        if p is not None:
            f_need[st] = (F_ if where[p] == where[st] else XF_) + p * C
        if n is not None:
            b_need[st] = (G_ if where[n] == where[st] else XG_) + n * C
    return f_need, b_need


def _channels(schedule: Schedule, C: int, XF_: int, XG_: int):
    """The channels (src, dst): their index by (src, dst), their ends, their messages in the sender's program
    order as the receive each one meets (RECV kind, stage, mb), and for each delivered key its (channel, index)."""
    channel_of: dict[tuple[int, int], int] = {}
    channel_ends: list[tuple[int, int]] = []
    channel_msgs: list[list[tuple[Kind, int, int]]] = []
    message_slot: dict[int, tuple[int, int]] = {}
    for src, acts in enumerate(schedule.actions):
        for a in acts:
            kind = a[0]
            if kind is Kind.SEND_F or kind is Kind.SEND_B:
                ch = channel_of.get((src, a[5]))
                if ch is None:
                    ch = channel_of[(src, a[5])] = len(channel_ends)
                    channel_ends.append((src, a[5]))
                    channel_msgs.append([])
                key = (XF_ if kind is Kind.SEND_F else XG_) + a[1] * C + a[2]
                message_slot[key] = (ch, len(channel_msgs[ch]))
                channel_msgs[ch].append((Kind.RECV_F if kind is Kind.SEND_F else Kind.RECV_B, a[1], a[2]))
    return channel_of, channel_ends, channel_msgs, message_slot


_RECV, _SEND, _ONE, _PAIR = 0, 1, 2, 3  # program entry codes


def _programs(schedule: Schedule, C: int, F_: int, G_: int, I_: int, XF_: int, XG_: int) -> list[list[tuple]]:
    """Each rank's program as the engine reads it, every key and index worked out once per schedule (a lowered
    schedule is simulated many times with other prices: predict's runs, a tune's hundreds of layouts). Measured on a
    ZB1P of 10^6 actions: ~300 bytes an action while the schedule lives, and a one-off simulation as fast as when
    each run decoded the actions itself (7.1 against 7.2 s):
      (_RECV, channel, index)                      its message's slot; channel -1: no send delivers it
      (_SEND, key, channel, index)                 the tensor it waits for, its slot (the index-th send on it)
      (_ONE or _PAIR, n1, n2, n3, m1, m2, price, grad, action, kind name, partner)
    for a compute action: the keys it waits for (-1: none; a pair's forward input n1, its backward's n2, n3) and
    publishes, its price slot (kind and stage, a pair's two stages), the stage whose gradients it writes (-1:
    none) and what its span records."""
    S = schedule.num_stages
    f_need, b_need = derived(schedule, "engine stage needs", lambda: _stage_needs(schedule, C, F_, G_, XF_, XG_))
    channel_of, _, _, message_slot = derived(schedule, "engine channels",
                                             lambda: _channels(schedule, C, XF_, XG_))
    price_base = {Kind.F: 0, Kind.W: S, Kind.I: 2 * S, Kind.B: 3 * S}
    out: list[list[tuple]] = []
    for r, acts in enumerate(schedule.actions):
        prog: list[tuple] = []
        sent: dict[int, int] = {}
        for a in acts:
            kind, st, mb = a[0], a[1], a[2]
            if kind is Kind.RECV_F or kind is Kind.RECV_B:
                slot = message_slot.get((XF_ if kind is Kind.RECV_F else XG_) + st * C + mb, (-1, -1))
                prog.append((_RECV, slot[0], slot[1]))
                continue
            if kind is Kind.SEND_F or kind is Kind.SEND_B:
                ch = channel_of[(r, a[5])]
                index = sent.get(ch, 0)
                sent[ch] = index + 1
                prog.append((_SEND, (F_ if kind is Kind.SEND_F else G_) + st * C + mb, ch, index))
                continue
            k = st * C + mb
            n2 = n3 = m2 = -1
            if kind is Kind.F:
                off = f_need[st]
                n1, m1, grad = (off + mb if off >= 0 else -1), F_ + k, -1
            elif kind is Kind.W:
                n1, m1, grad = I_ + k, -1, st
            elif kind is Kind.FB:
                bs, bm = a[3], a[4]
                off, boff = f_need[st], b_need[bs]
                n1 = off + mb if off >= 0 else -1
                n2 = F_ + bs * C + bm
                n3 = boff + bm if boff >= 0 else -1
                m1, m2, grad = F_ + k, G_ + bs * C + bm, bs
                prog.append((_PAIR, n1, n2, n3, m1, m2, 4 * S + st * S + bs, grad, a, kind._value_, (bs, bm)))
                continue
            else:  # I or B
                off = b_need[st]
                n1, n2, m1, grad = F_ + k, (off + mb if off >= 0 else -1), G_ + k, st
                if kind is Kind.I:
                    m2 = I_ + k
            prog.append((_ONE, n1, n2, n3, m1, m2, price_base[kind] + st, grad, a, kind._value_, None))
        out.append(prog)
    return out


@dataclass(frozen=True)
class Tables:
    """What the engine reads of a lowered schedule, worked out once per object (_programs, _channels): the
    micro-batches per stage C, the key offsets of delivered activations and gradients, each rank's program, each
    channel's (src, dst) and its messages in the sender's order."""

    C: int
    XF: int
    XG: int
    programs: list[list[tuple]]
    channel_ends: list[tuple[int, int]]
    channel_msgs: list[list[tuple[Kind, int, int]]]


def tables(schedule: Schedule) -> Tables:
    C = max(1, schedule.microbatches_per_pipeline)
    SC = schedule.num_stages * C
    F_, G_, I_, XF_, XG_ = 0, SC, 2 * SC, 3 * SC, 4 * SC
    with collector_paused():  # a tuple per action and no cycles: the collector's passes would double the build
        programs = derived(schedule, "engine programs", lambda: _programs(schedule, C, F_, G_, I_, XF_, XG_))
    _, ends, msgs, _ = derived(schedule, "engine channels", lambda: _channels(schedule, C, XF_, XG_))
    return Tables(C, XF_, XG_, programs, ends, msgs)


def run_engine(schedule: Schedule, compute_time: Callable[[Action], float],
               transfer_time: Callable[[Action], float], record: bool = True, *,
               fb_timing: Callable[[Action, float, float], tuple[float, float, float]] | None = None,
               p2p: str = "commit", order: list[tuple[int, int, int]] | None = None) -> EngineResult:
    """Execute a lowered schedule. Returns spans (when `record`) or the actions ranks are stuck at.

    `compute_time` is called once per distinct (kind, stage[, backward stage]), `transfer_time` once per
    message kind and `fb_timing` once per (stage, backward stage, lags): costs may depend on those, not on the
    micro-batch. The dependency keys of deps.py are
    encoded as integers code*S*C + stage*C + mb (codes F, G, I, XF, XG = 0..4) and specialised per action once per
    schedule (`_programs`); tests check this engine against the explicit graph built from deps.py.
    `order`: a list the run appends what it handled to, in the order it did, (0, rank, index) for a compute
    action and (1, channel, index) for a transfer (schedules.replay compiles a rerun from it).
    """
    if p2p not in P2P_MODES:
        raise ValueError(f"p2p {p2p!r}: choose one of {', '.join(P2P_MODES)}")
    post_when_produced = p2p != "commit"
    always_posted = p2p == "dataflow"
    P, S = schedule.num_ranks, schedule.num_stages
    tab = tables(schedule)
    C, XF_, XG_, programs, channel_ends, channel_msgs = (tab.C, tab.XF, tab.XG, tab.programs, tab.channel_ends,
                                                        tab.channel_msgs)
    SC = S * C
    KRF = Kind.RECV_F
    num_channels = len(channel_ends)
    send_ready = [[None] * len(m) for m in channel_msgs]
    recv_post = [[None] * len(m) for m in channel_msgs]
    chan_next = [0] * num_channels
    chan_end = [0.0] * num_channels
    xfer_time: dict[Kind, float] = {}

    dur: list[float | None] = [None] * (4 * S + S * S)  # per price slot (_programs), filled on first use
    fb_timed: dict[tuple, tuple[float, float, float]] = {}  # (price slot, lags) -> the pair's fb_timing
    done: list[float | None] = [None] * (5 * SC)
    waiters: dict[int, list[int]] = {}
    ptr = [0] * P
    free = [0.0] * P
    busy = [0.0] * P
    grad_done: list[float | None] = [None] * S
    ready = deque(range(P))
    queued = [True] * P
    spans: list[Span] = []
    span = Span

    def wake(key: int) -> None:
        for r in waiters.pop(key):
            if not queued[r]:
                queued[r] = True
                ready.append(r)

    def resolve(ch: int) -> None:
        msgs, sr, rp = channel_msgs[ch], send_ready[ch], recv_post[ch]
        i, prev_end, n = chan_next[ch], chan_end[ch], len(msgs)
        while i < n:
            s_t, r_t = sr[i], rp[i]
            if s_t is None or r_t is None:
                break
            kind, st, mb = msgs[i]
            start = s_t if s_t > r_t else r_t
            if prev_end > start:
                start = prev_end
            d = xfer_time.get(kind)
            if d is None:
                d = xfer_time[kind] = transfer_time(Action(kind, st, mb, -1, -1, channel_ends[ch][0]))
            prev_end = start + d
            if order is not None:
                order.append((1, ch, i))
            if record:
                src, dst = channel_ends[ch]
                spans.append(span(src, "comm", "SEND_F" if kind is KRF else "SEND_B", st, mb, start, d, None, dst))
                spans.append(span(dst, "comm", kind._value_, st, mb, start, d, None, src))
            key = (XF_ if kind is KRF else XG_) + st * C + mb
            done[key] = prev_end
            if key in waiters:
                wake(key)
            i += 1
        chan_next[ch], chan_end[ch] = i, prev_end

    while ready:
        r = ready.popleft()
        queued[r] = False
        prog = programs[r]
        i, n, t_free = ptr[r], len(prog), free[r]
        while i < n:
            op = prog[i]
            code = op[0]
            if code == _RECV:  # post the receive and move on
                ch, index = op[1], op[2]
                if ch < 0:
                    ptr[r], free[r] = i, t_free
                    return EngineResult(False, spans, {r: schedule.actions[r][i]})
                recv_post[ch][index] = 0.0 if always_posted else t_free
                # only the channel's head message can start a transfer, and only once its send is posted too
                if index == chan_next[ch] and send_ready[ch][index] is not None:
                    resolve(ch)
                i += 1
                continue
            if code == _SEND:
                key, ch, index = op[1], op[2], op[3]
                v = done[key]
                if v is None:
                    waiters.setdefault(key, []).append(r)
                    break
                send_ready[ch][index] = v if (post_when_produced or v > t_free) else t_free
                if index == chan_next[ch] and recv_post[ch][index] is not None:
                    resolve(ch)
                i += 1
                continue
            # up to three keys to wait for (n1..n3, -1 = none) and two to publish (m1, m2)
            _, n1, n2, n3, m1, m2, slot, g, a, name, partner = op
            t = t_free
            v1 = v3 = 0.0
            if n1 >= 0:
                v1 = done[n1]
                if v1 is None:
                    waiters.setdefault(n1, []).append(r)
                    break
                if v1 > t:
                    t = v1
            if n2 >= 0:
                v = done[n2]
                if v is None:
                    waiters.setdefault(n2, []).append(r)
                    break
                if v > t:
                    t = v
                if v > v3:
                    v3 = v
            if n3 >= 0:
                v = done[n3]
                if v is None:
                    waiters.setdefault(n3, []).append(r)
                    break
                if v > t:
                    t = v
                if v > v3:
                    v3 = v
            r1 = r2 = None  # when the outputs are ready, from the action's start (None: at its end)
            if code == _PAIR and fb_timing is not None:  # start with the first input there; each half waits for its own
                t = max(t_free, min(v1, v3))
                # most pairs have both inputs on time, and lags recur in a periodic schedule: one call per pair of
                # stages and lags, like compute_time's per stage
                lags = (slot, max(0.0, v1 - t), max(0.0, v3 - t))
                got = fb_timed.get(lags)
                if got is None:
                    got = fb_timed[lags] = fb_timing(a, lags[1], lags[2])
                d, r1, r2 = got
            else:
                d = dur[slot]
                if d is None:
                    d = dur[slot] = compute_time(a)
            t_free = t + d
            busy[r] += d
            if order is not None:
                order.append((0, r, i))
            if g >= 0:  # the stage whose gradients it writes
                v = grad_done[g]
                if v is None or t_free > v:
                    grad_done[g] = t_free
            if record:
                spans.append(span(r, "compute", name, a[1], a[2], t, d, partner))
            if m1 >= 0:
                done[m1] = t_free if r1 is None else t + r1
                if m1 in waiters:
                    wake(m1)
            if m2 >= 0:
                done[m2] = t_free if r2 is None else t + r2
                if m2 in waiters:
                    wake(m2)
            i += 1
        ptr[r], free[r] = i, t_free

    actions = schedule.actions
    blocked_at = {r: actions[r][ptr[r]] for r in range(P) if ptr[r] < len(actions[r])}
    return EngineResult(not blocked_at, spans, blocked_at, busy, free, grad_done)
