"""The one lowering pass that derives P2P actions from compute actions (generators never write them).

Placement rules (our asynchronous runtime, schedules.md §6):
* a SEND goes right after the compute action that produces its tensor, and is not waited on by compute;
* a RECV is posted one compute action ahead of its consumer (before the preceding compute), so the transfer
  overlaps that compute; the consumer waits only on its own receives;
* on every channel (src rank -> dst rank) the receiver posts in the sender's order, as NCCL and gloo match
  P2P messages in posting order: a receive posted early also posts the channel's earlier messages.
"""
from __future__ import annotations

from collections import defaultdict

from schedules.ir import COMM_KINDS, Action, Kind, Schedule

PREFETCH_DEPTH = 1  # receives are posted this many compute actions before their consumer


class Links:
    """Per stage: who its P2P partners are (-1 where the neighbour is on the same rank or absent)."""

    __slots__ = ("send_f", "send_b", "recv_f", "recv_b")

    def __init__(self, schedule: Schedule):
        S, where = schedule.num_stages, schedule.stage_to_rank
        prev, nxt = schedule.prev_stage(), schedule.next_stage()
        self.send_f = [-1] * S  # rank the forward output goes to
        self.send_b = [-1] * S  # rank the input-grad goes to
        self.recv_f: list[tuple[int, int] | None] = [None] * S  # (producer stage, rank) of the input
        self.recv_b: list[tuple[int, int] | None] = [None] * S  # (producer stage, rank) of the output-grad
        for s in range(S):
            p, n = prev.get(s), nxt.get(s)
            if n is not None and where[n] != where[s]:
                self.send_f[s] = where[n]
                self.recv_b[s] = (n, where[n])
            if p is not None and where[p] != where[s]:
                self.send_b[s] = where[p]
                self.recv_f[s] = (p, where[p])


def _halves(a: Action) -> tuple[tuple[bool, int, int], ...]:
    """(is_forward, stage, mb) of the compute parts of `a`."""
    if a.kind is Kind.FB:
        return ((True, a.stage, a.mb), (False, a.b_stage, a.b_mb))
    if a.kind is Kind.F:
        return ((True, a.stage, a.mb),)
    if a.kind is Kind.W:
        return ()
    return ((False, a.stage, a.mb),)


def outgoing(a: Action, links: Links) -> list[Action]:
    """SEND actions a compute action triggers (cross-rank edges only; the V bottom is a local hand-off)."""
    sends = []
    for forward, stage, mb in _halves(a):
        peer = links.send_f[stage] if forward else links.send_b[stage]
        if peer >= 0:
            sends.append(Action(Kind.SEND_F if forward else Kind.SEND_B, stage, mb, -1, -1, peer))
    return sends


def incoming(a: Action, links: Links) -> list[Action]:
    """RECV actions a compute action consumes (labelled with the producer's stage)."""
    recvs = []
    for forward, stage, mb in _halves(a):
        src = links.recv_f[stage] if forward else links.recv_b[stage]
        if src is not None:
            recvs.append(Action(Kind.RECV_F if forward else Kind.RECV_B, src[0], mb, -1, -1, src[1]))
    return recvs


def lower_comms(schedule: Schedule) -> Schedule:
    """Insert SEND/RECV actions into a compute-only schedule."""
    if schedule.lowered:
        raise ValueError("lower_comms: schedule already has SEND/RECV actions; lower a compute-only schedule")
    links = Links(schedule)

    # Sender side first: it fixes every channel's message order.
    with_sends: list[list[Action]] = []
    channel_order: dict[tuple[int, int], list[Action]] = defaultdict(list)  # (src, dst) -> RECVs in send order
    for rank, acts in enumerate(schedule.actions):
        out: list[Action] = []
        for a in acts:
            out.append(a)
            for s in outgoing(a, links):
                out.append(s)
                recv_kind = Kind.RECV_F if s.kind is Kind.SEND_F else Kind.RECV_B
                channel_order[(rank, s.peer)].append(Action(recv_kind, s.stage, s.mb, -1, -1, rank))
        with_sends.append(out)

    position_in_channel: list[dict[Action, int]] = [{} for _ in schedule.actions]
    for (src, dst), msgs in channel_order.items():
        for i, m in enumerate(msgs):
            position_in_channel[dst][m] = i

    lowered = []
    for rank, acts in enumerate(with_sends):
        compute_positions = [i for i, a in enumerate(acts) if a.kind not in COMM_KINDS]
        posts_before: dict[int, list[Action]] = defaultdict(list)  # index in acts -> RECVs posted just before
        next_in_channel: dict[tuple[int, int], int] = defaultdict(int)
        for k, idx in enumerate(compute_positions):
            post_at = compute_positions[max(0, k - PREFETCH_DEPTH)]
            for r in incoming(acts[idx], links):
                channel = (r.peer, rank)
                msgs = channel_order.get(channel, [])
                want = position_in_channel[rank].get(r)
                if want is None:
                    raise ValueError(f"lower_comms: rank {rank} consumes {r} but rank {r.peer} never sends it; "
                                     "the compute schedule is malformed (run schedules.validate on it)")
                while next_in_channel[channel] <= want:
                    posts_before[post_at].append(msgs[next_in_channel[channel]])
                    next_in_channel[channel] += 1
        out = []
        for i, a in enumerate(acts):
            out.extend(posts_before.get(i, ()))
            out.append(a)
        lowered.append(tuple(out))
    return schedule.with_actions(tuple(lowered), lowered=True)
