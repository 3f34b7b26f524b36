"""The one lowering pass that derives P2P actions from compute actions (generators never write them).

Placement rules (our asynchronous runtime, schedules.md §6):
* a SEND goes right after the compute action that produces its tensor, and is not waited on by compute;
* a RECV is posted one compute action ahead of its consumer (before the preceding compute), so the transfer
  overlaps that compute; the consumer waits only on its own receives;
* on every channel (src rank -> dst rank) the receiver posts in the sender's order, as NCCL and gloo match
  P2P messages in posting order: a receive posted early also posts the channel's earlier messages.
"""
from __future__ import annotations


from schedules.ir import COMM_KINDS, Action, Kind, Schedule

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
    """Insert SEND/RECV actions into a compute-only schedule (the rules are in the module docstring)."""
    if schedule.lowered:
        raise ValueError("lower_comms: schedule already has SEND/RECV actions; lower a compute-only schedule")
    links = Links(schedule)
    C = max(1, schedule.microbatches_per_pipeline)
    with_sends, channel_msgs, slot = _with_sends(schedule, links, C)
    lowered = _with_recvs(with_sends, links, C, schedule.num_stages * C, channel_msgs, slot)
    return schedule.with_actions(tuple(lowered), lowered=True)


def _with_sends(schedule: Schedule, links: Links, C: int):
    """Sender side first: SENDs right after their producer; this fixes every channel's message order. Returns the
    programs with their SENDs, per channel the RECVs in send order, and each message key's (channel, index)."""
    send_f, send_b = links.send_f, links.send_b
    KF, KFB, KW = Kind.F, Kind.FB, Kind.W
    KSF, KSB, KRF, KRB = Kind.SEND_F, Kind.SEND_B, Kind.RECV_F, Kind.RECV_B
    SC = schedule.num_stages * C
    new = tuple.__new__  # NamedTuple construction without its Python-level __new__: this runs per message
    channel_id: dict[tuple[int, int], int] = {}
    channel_msgs: list[list[Action]] = []  # per channel: the RECVs in send order
    slot: dict[int, tuple[int, int]] = {}  # message key (as in simulate.py) -> (channel, index)

    def emit(out: list, rank: int, forward: bool, st: int, mb: int) -> None:
        peer = send_f[st] if forward else send_b[st]
        if peer < 0:
            return
        out.append(new(Action, (KSF if forward else KSB, st, mb, -1, -1, peer)))
        ch = channel_id.get((rank, peer))
        if ch is None:
            ch = channel_id[(rank, peer)] = len(channel_msgs)
            channel_msgs.append([])
        msgs = channel_msgs[ch]
        slot[(0 if forward else SC) + st * C + mb] = (ch, len(msgs))
        msgs.append(new(Action, (KRF if forward else KRB, st, mb, -1, -1, rank)))

    with_sends: list[list[Action]] = []
    for rank, acts in enumerate(schedule.actions):
        out: list[Action] = []
        for a in acts:
            out.append(a)
            kind = a[0]
            if kind is KW:
                continue
            if kind is KFB:
                emit(out, rank, True, a[1], a[2])
                emit(out, rank, False, a[3], a[4])
            elif (send_f if kind is KF else send_b)[a[1]] >= 0:
                emit(out, rank, kind is KF, a[1], a[2])
        with_sends.append(out)

    return with_sends, channel_msgs, slot


def _with_recvs(with_sends: list, links: Links, C: int, SC: int, channel_msgs: list, slot: dict) -> list:
    """Receiver side: post each RECV one compute action ahead of its consumer, in channel order."""
    recv_f, recv_b = links.recv_f, links.recv_b
    KF, KFB, KW = Kind.F, Kind.FB, Kind.W
    next_in_channel = [0] * len(channel_msgs)

    def post(rank: int, forward: bool, st: int, mb: int, pending: list) -> None:
        src = recv_f[st] if forward else recv_b[st]
        if src is None:
            return
        found = slot.get((0 if forward else SC) + src[0] * C + mb)
        if found is None:
            raise ValueError(f"lower_comms: rank {rank} consumes {'F' if forward else 'B'} of stage {src[0]} "
                             f"mb {mb} but rank {src[1]} never produces it; the compute schedule is malformed "
                             "(run schedules.validate_schedule on it)")
        ch, want = found
        msgs = channel_msgs[ch]
        while next_in_channel[ch] <= want:
            pending.append(msgs[next_in_channel[ch]])
            next_in_channel[ch] += 1

    lowered = []
    for rank, acts in enumerate(with_sends):
        posts_before: dict[int, list[Action]] = {}  # index in acts -> RECVs posted just before it
        previous_compute = -1
        for idx, a in enumerate(acts):
            kind = a[0]
            if kind in COMM_KINDS:
                continue
            post_at = idx if previous_compute < 0 else previous_compute
            previous_compute = idx
            if kind is KW:
                continue
            pending = posts_before.get(post_at)
            if pending is None:
                pending = posts_before[post_at] = []
            if kind is KFB:
                post(rank, True, a[1], a[2], pending)
                post(rank, False, a[3], a[4], pending)
            elif (recv_f if kind is KF else recv_b)[a[1]] is not None:
                post(rank, kind is KF, a[1], a[2], pending)
        out = []
        for i, a in enumerate(acts):
            pending = posts_before.get(i)
            if pending:
                out.extend(pending)
            out.append(a)
        lowered.append(tuple(out))
    return lowered
