"""A lowered schedule rerun with new prices as straight-line code: the engine's run (schedules.engine) once, then a
max-plus pass over its actions and transfers in the order that run handled them.

Why: `mhcpipe tune` simulates a few lowered schedules with hundreds of price sets (paper-27b: 114 runs of 9
schedules, ~10^4 program entries each). The engine parks ranks on missing inputs and wakes them, which is what
finding an order (and a deadlock) needs; a rerun of a schedule that completed needs none of it. Which entry
waits for which is fixed by the schedule, not by the prices (a compute action waits for its keys, a transfer for
both sides' posts and the channel's previous message), so the order of the first run is a topological order of
every later one, and each time is
    end = max(the inputs' times) + duration
over the same inputs the engine reads, in the same float operations: the replay's numbers equal the engine's
bit for bit (tests/schedules/test_replay.py checks every schedule kind, P2P rule and F&B pairing).

Nodes, one per compute action and per transfer, each reading four time slots (slot 0 is the constant 0.0: an
input that is not there):
* a compute action: the rank's previous compute action (its stream is free), and the keys it consumes;
* a transfer: the tensor it sends, the sender's previous compute action (when it posted the send, "commit"), the
  receiver's previous compute action (when it posted the receive; not in "dataflow") and the channel's previous
  message (FIFO);
* an F&B pair with `fb_timing`: starts with the first of its halves' inputs, each half lagging until its own
  (the engine's rule), and writes its end and each half's output time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from schedules.engine import _ONE, _PAIR, _RECV, _SEND, EngineResult, P2P_MODES, run_engine, tables
from schedules.ir import Action, Kind, Schedule
from schedules.memo import derived, recalled

_FORMS = {"commit": (True, True), "rendezvous": (False, True), "dataflow": (False, False)}
assert set(_FORMS) == set(P2P_MODES)


@dataclass
class Plan:
    """A completed run's order compiled per P2P rule (`nodes[p2p]`, built when first asked)."""

    slots: int  # time slots, slot 0 the constant 0.0
    prices: list[tuple[int, Action]]  # (price slot, the first action priced there), in the engine's call order
    transfers: list[tuple[int, Action]]  # (price slot, the first message of its kind), in the engine's call order
    width: int  # price slots: the engine's compute slots, then one per message kind
    compute: list[tuple]  # per node in order: (4 input slots, price slot or -1 - its index in pairs, out slot)
    pairs: list[tuple[int, int, int, Action]]  # an F&B pair's price slot, its halves' output slots, its action
    transfer_inputs: dict[int, tuple]  # node index -> (sent tensor, sender's prev, receiver's prev, channel's prev)
    ranks: list[list[tuple[int, int]]]  # per rank, its compute nodes in program order: (price slot, out slot)
    writers: list[list[int]]  # per stage, the out slots of the actions writing its gradients
    last: list[int]  # per rank, the out slot of its last compute action (0: none)
    _nodes: dict[str, list[tuple]]

    def nodes(self, p2p: str) -> list[tuple]:
        """The nodes under a P2P rule: a transfer reads the sides' posts only where the rule waits for them."""
        got = self._nodes.get(p2p)
        if got is None:
            sender, receiver = _FORMS[p2p]
            got = list(self.compute)
            for k, (sent, send_post, recv_post, channel) in self.transfer_inputs.items():
                got[k] = (sent, send_post if sender else 0, recv_post if receiver else 0, channel, *got[k][4:])
            self._nodes[p2p] = got
        return got


def compile_plan(schedule: Schedule, order: list[tuple[int, int, int]]) -> Plan:
    """The plan of a lowered schedule from the order a completed run_engine(order=...) handled it in."""
    tab = tables(schedule)
    progs, C, XF, XG = tab.programs, tab.C, tab.XF, tab.XG
    # per message (channel, index): its sender, its receiver, and how many compute actions each had issued when it
    # posted its side (the post time is the end of the last of them: the rank's stream was free then)
    sends = [[(0, 0, 0)] * len(m) for m in tab.channel_msgs]  # (rank, computes before, the sent tensor's key)
    recvs = [[(0, 0)] * len(m) for m in tab.channel_msgs]  # (rank, computes before)
    for r, prog in enumerate(progs):
        k = 0
        for op in prog:
            code = op[0]
            if code == _SEND:
                sends[op[2]][op[3]] = (r, k, op[1])
            elif code == _RECV:
                recvs[op[1]][op[2]] = (r, k)
            else:
                k += 1
    slot_of = [0] * (5 * schedule.num_stages * C)  # engine key -> the time slot holding when it is ready
    nodes: list[tuple] = []
    transfer_inputs: dict[int, tuple] = {}
    prices: dict[int, Action] = {}
    transfers: dict[Kind, int] = {}
    transfer_actions: list[tuple[int, Action]] = []
    base = 4 * schedule.num_stages + schedule.num_stages ** 2  # the engine's compute price slots (_programs)
    channel_last = [0] * len(tab.channel_msgs)
    ranks: list[list[tuple[int, int]]] = [[] for _ in progs]
    ends: list[list[int]] = [[0] for _ in progs]  # per rank: 0, then its compute actions' end slots in order
    writers: list[list[int]] = [[] for _ in range(schedule.num_stages)]
    pairs: list[tuple[int, int, int, Action]] = []
    slots = 1
    for what, a, b in order:
        if what == 1:  # a transfer: channel a, its b-th message
            kind, st, mb = tab.channel_msgs[a][b]
            src, k_src, key = sends[a][b]
            dst, k_dst = recvs[a][b]
            price = transfers.get(kind)
            if price is None:  # the engine prices a message kind at its first transfer, from its channel's source
                price = transfers[kind] = base + len(transfer_actions)
                transfer_actions.append((price, Action(kind, st, mb, -1, -1, tab.channel_ends[a][0])))
            ins = (slot_of[key], ends[src][k_src], ends[dst][k_dst], channel_last[a])
            transfer_inputs[len(nodes)] = ins
            nodes.append((*ins, price, slots))
            channel_last[a] = slot_of[(XF if kind is Kind.RECV_F else XG) + st * C + mb] = slots
            slots += 1
            continue
        code, n1, n2, n3, m1, m2, price, grad, action, _, _ = progs[a][b]
        ins = (ends[a][-1], slot_of[n1] if n1 >= 0 else 0, slot_of[n2] if n2 >= 0 else 0,
               slot_of[n3] if n3 >= 0 else 0)
        prices.setdefault(price, action)
        end = slots
        if code == _PAIR:  # its price slot among the pairs, negative: (price slot, forward out, backward out, action)
            nodes.append((*ins, -1 - len(pairs), end))
            pairs.append((price, end + 1, end + 2, action))
            slot_of[m1], slot_of[m2] = end + 1, end + 2
            slots += 3
        else:
            assert code == _ONE
            nodes.append((*ins, price, end))
            if m1 >= 0:
                slot_of[m1] = end
            if m2 >= 0:
                slot_of[m2] = end
            slots += 1
        ends[a].append(end)
        ranks[a].append((price, end))
        if grad >= 0:
            writers[grad].append(end)
    return Plan(slots, list(prices.items()), transfer_actions, base + len(transfer_actions), nodes, pairs,
                transfer_inputs, ranks, writers, [e[-1] for e in ends], {})


def replay(plan: Plan, compute_time: Callable[[Action], float], transfer_time: Callable[[Action], float], *,
           fb_timing: Callable[[Action, float, float], tuple[float, float, float]] | None = None,
           p2p: str = "commit") -> EngineResult:
    """run_engine(schedule, ..., record=False) of a schedule whose plan this is, without the engine's queues."""
    if p2p not in P2P_MODES:
        raise ValueError(f"p2p {p2p!r}: choose one of {', '.join(P2P_MODES)}")
    dur = [0.0] * plan.width  # per price slot; a pair's slot too, read only without fb_timing
    for s, a in plan.prices:
        dur[s] = compute_time(a)
    for s, a in plan.transfers:
        dur[s] = transfer_time(a)
    T = [0.0] * plan.slots
    pair_time: dict[int, float] = {}  # a pair's end slot -> its duration (busy time)
    timed: dict[tuple, tuple[float, float, float]] = {}  # (price slot, lags) -> fb_timing, as the engine asks it
    pairs = plan.pairs
    for a, b, c, d, s, o in plan.nodes(p2p):
        if s >= 0 or fb_timing is None:  # max(T[a], T[b], T[c], T[d]) + duration, the comparisons written out
            t = T[a]  # (twice as fast as max() on 10^4 nodes a run)
            v = T[b]
            if v > t:
                t = v
            v = T[c]
            if v > t:
                t = v
            v = T[d]
            if v > t:
                t = v
            if s >= 0:
                T[o] = t + dur[s]
            else:  # a pair without fb_timing: both outputs at its end, as the engine does
                s, fo, bo, _ = pairs[-1 - s]
                T[o] = T[fo] = T[bo] = t + dur[s]
            continue
        s, fo, bo, action = pairs[-1 - s]  # the engine's rule: start with the first half's input, each half lags
        v1, v3 = T[b], T[c] if T[c] > T[d] else T[d]
        t = min(v1, v3)
        if T[a] > t:
            t = T[a]
        lags = (s, v1 - t if v1 > t else 0.0, v3 - t if v3 > t else 0.0)  # max(0.0, v - t), written out
        got = timed.get(lags)
        if got is None:
            got = timed[lags] = fb_timing(action, lags[1], lags[2])
        d, r1, r2 = got
        T[o] = t + d
        T[fo] = T[o] if r1 is None else t + r1
        T[bo] = T[o] if r2 is None else t + r2
        pair_time[o] = d
    busy = []
    for nodes in plan.ranks:  # summed in program order, as the engine adds them
        total = 0.0
        for s, o in nodes:
            total += pair_time[o] if o in pair_time else dur[s]
        busy.append(total)
    grad = [max(T[o] for o in w) if w else None for w in plan.writers]
    return EngineResult(True, [], {}, busy, [T[o] for o in plan.last], grad)


def run_without_spans(schedule: Schedule, compute_time: Callable[[Action], float],
                      transfer_time: Callable[[Action], float], *,
                      fb_timing: Callable[[Action, float, float], tuple[float, float, float]] | None = None,
                      p2p: str = "commit") -> EngineResult:
    """run_engine(..., record=False): the engine the first time a lowered schedule runs, the replay of its order
    from then on (a schedule that deadlocked gets no plan: the engine reports it every time)."""
    plan = recalled(schedule, "engine replay")
    if plan is not None:
        return replay(plan, compute_time, transfer_time, fb_timing=fb_timing, p2p=p2p)
    order: list[tuple[int, int, int]] = []
    result = run_engine(schedule, compute_time, transfer_time, record=False, fb_timing=fb_timing, p2p=p2p,
                        order=order)
    if result.completed:
        derived(schedule, "engine replay", lambda: compile_plan(schedule, order))
    return result
