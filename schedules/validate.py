"""Validation of a schedule: counts, per-chunk order, P2P pairing and deadlock freedom.

`validate_schedule` raises `ScheduleError` (a ValueError) listing every broken rule with the ranks and actions
involved; for a deadlock it shows the dependency cycle.
"""
from __future__ import annotations

from collections import Counter, defaultdict

from schedules.engine import run_engine
from schedules.ir import COMM_KINDS, Kind, Schedule
from schedules.lowering import lower_comms

MAX_REPORTED = 8


class ScheduleError(ValueError):
    """The schedule breaks a rule; the message lists what and where."""


def _structure_problems(s: Schedule) -> list[str]:
    problems = []
    if len(s.actions) != s.num_ranks:
        problems.append(f"actions has {len(s.actions)} rank lists but num_ranks is {s.num_ranks}")
    if any(not 0 <= r < s.num_ranks for r in s.stage_to_rank):
        problems.append(f"stage_to_rank {s.stage_to_rank} names ranks outside 0..{s.num_ranks - 1}")
    chained = sorted(st for chain in s.pipelines for st in chain)
    if chained != list(range(s.num_stages)):
        problems.append(f"pipelines {s.pipelines} must cover every stage 0..{s.num_stages - 1} exactly once")
    if s.num_microbatches % len(s.pipelines):
        problems.append(f"{s.num_microbatches} micro-batches do not split evenly over {len(s.pipelines)} pipelines")
    return problems


def _compute_problems(s: Schedule) -> list[str]:
    """One pass over the compute actions: placement, counts per chunk, per-rank order.

    Rules: each (stage, mb) has exactly one F and exactly one B or one I plus one W, all on the stage's rank;
    on that rank F precedes I/B precedes W; consecutive stages held by one rank (the V bottom) run their
    forwards in pipeline order and their backwards in reverse order.
    """
    S, C = s.num_stages, s.microbatches_per_pipeline
    n = S * C
    # per chunk k = stage * C + mb: count and first rank-local position of each part (F, I, W, B); the lists
    # are indexed by a small int rather than keyed by Kind because this loop sees every action
    counts = [[0] * n for _ in range(4)]
    firsts = [[-1] * n for _ in range(4)]
    stage_to_rank = s.stage_to_rank
    problems: list[str] = []
    KF, KI, KW, KFB, KRF, KRB = Kind.F, Kind.I, Kind.W, Kind.FB, Kind.RECV_F, Kind.RECV_B
    for r, acts in enumerate(s.actions):
        for i, a in enumerate(acts):
            kind = a[0]
            if kind in COMM_KINDS:
                if kind is KRF or kind is KRB:
                    ok = 0 <= a.stage < S and stage_to_rank[a.stage] == a.peer
                    where = f"the sender (peer) must be rank {stage_to_rank[a.stage] if 0 <= a.stage < S else '?'}"
                else:
                    ok = 0 <= a.stage < S and stage_to_rank[a.stage] == r
                    where = "a SEND must be on the producing stage's rank"
                if not ok:
                    problems.append(f"rank {r} #{i} {a}: {where}")
                continue
            if kind is KFB:
                halves = ((0, a[1], a[2]), (3, a[3], a[4]))
            else:
                halves = ((0 if kind is KF else 1 if kind is KI else 2 if kind is KW else 3, a[1], a[2]),)
            for part, stage, mb in halves:
                if not (0 <= stage < S and 0 <= mb < C):
                    problems.append(f"rank {r} #{i} {a}: stage must be in 0..{S - 1} and micro-batch in 0..{C - 1}")
                    continue
                if stage_to_rank[stage] != r:
                    problems.append(f"rank {r} #{i} {a}: stage {stage} is placed on rank {stage_to_rank[stage]}")
                    continue
                k = stage * C + mb
                counts[part][k] += 1
                if firsts[part][k] < 0:
                    firsts[part][k] = i
    if problems:
        return problems
    nxt = s.next_stage()
    F, I, W, B = firsts
    for stage in range(S):
        r = stage_to_rank[stage]
        n_stage = nxt.get(stage)
        local_next = n_stage is not None and stage_to_rank[n_stage] == r
        for mb in range(C):
            k = stage * C + mb
            f, i, w, b = (c[k] for c in counts)
            if f != 1:
                problems.append(f"stage {stage} mb {mb}: {f} forwards (F), expected exactly 1")
            if not ((b == 1 and i == 0 and w == 0) or (b == 0 and i == 1 and w == 1)):
                problems.append(f"stage {stage} mb {mb}: backward is B x{b}, I x{i}, W x{w}; expected exactly one "
                                "B, or exactly one I and one W")
                continue
            back = B[k] if b else I[k]
            if F[k] > back:
                problems.append(f"rank {r}: backward of stage {stage} mb {mb} (#{back}) comes before its forward "
                                f"(#{F[k]})")
            if i and W[k] < I[k]:
                problems.append(f"rank {r}: W of stage {stage} mb {mb} (#{W[k]}) comes before its I (#{I[k]})")
            if local_next:
                kn = n_stage * C + mb
                if F[kn] <= F[k]:
                    problems.append(f"rank {r}: F of stage {n_stage} mb {mb} runs before F of stage {stage}")
                back_next = B[kn] if B[kn] >= 0 else I[kn]
                if back_next > back:
                    problems.append(f"rank {r}: backward of stage {stage} mb {mb} runs before that of stage "
                                    f"{n_stage}")
            if len(problems) > 4 * MAX_REPORTED:
                return problems
    return problems


def _p2p_problems(s: Schedule) -> list[str]:
    from schedules.lowering import Links, incoming, outgoing

    links = Links(s)
    expected_sends: Counter = Counter()
    expected_recvs: Counter = Counter()
    for r, acts in enumerate(s.actions):
        for a in acts:
            if a.kind not in COMM_KINDS:
                expected_sends.update((r, x) for x in outgoing(a, links))
                expected_recvs.update((r, x) for x in incoming(a, links))
    actual: Counter = Counter((r, a) for r, acts in enumerate(s.actions) for a in acts if a.kind in COMM_KINDS)
    expected = expected_sends + expected_recvs
    problems = []
    for (r, a), n in sorted((actual - expected).items(), key=str)[:MAX_REPORTED]:
        problems.append(f"rank {r}: {a.kind.value}(stage {a.stage}, mb {a.mb}, peer {a.peer}) x{n} has no matching "
                        "compute edge (extra or duplicated P2P op)")
    for (r, a), n in sorted((expected - actual).items(), key=str)[:MAX_REPORTED]:
        problems.append(f"rank {r}: missing {a.kind.value}(stage {a.stage}, mb {a.mb}, peer {a.peer}); every "
                        "cross-rank edge needs one SEND on the producer and one RECV on the consumer")
    # per channel, both sides must post in the same order (messages match in posting order)
    sent: dict[tuple[int, int], list[tuple]] = defaultdict(list)
    received: dict[tuple[int, int], list[tuple]] = defaultdict(list)
    for r, acts in enumerate(s.actions):
        for a in acts:
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                sent[(r, a.peer)].append((a.kind.value[-1], a.stage, a.mb))
            elif a.kind in (Kind.RECV_F, Kind.RECV_B):
                received[(a.peer, r)].append((a.kind.value[-1], a.stage, a.mb))
    for ch in sorted(set(sent) | set(received)):
        if sorted(sent[ch]) == sorted(received[ch]) and sent[ch] != received[ch]:
            k = next(i for i, (x, y) in enumerate(zip(sent[ch], received[ch])) if x != y)
            problems.append(f"ranks {ch[0]} -> {ch[1]}: P2P ops are posted in different orders on the two sides "
                            f"(message {k}: rank {ch[0]} sends {_msg(sent[ch][k])} but rank {ch[1]} receives "
                            f"{_msg(received[ch][k])}); messages match in posting order, so this deadlocks or "
                            "delivers the wrong tensor")
    return problems


def _msg(m: tuple) -> str:
    return f"{'activation' if m[0] == 'F' else 'input-grad'} of stage {m[1]} mb {m[2]}"


def validate_schedule(schedule: Schedule) -> None:
    """Raise ScheduleError unless `schedule` satisfies every rule (a compute-only schedule is lowered first)."""
    lowered = check_structure(schedule)
    result = run_engine(lowered, lambda a: 0.0, lambda a: 0.0, record=False)
    if not result.completed:
        raise_deadlock(lowered, result.blocked)


def check_structure(schedule: Schedule) -> Schedule:
    """Every rule but deadlock freedom; returns the lowered schedule. P2P pairing is checked for schedules
    that arrive with SEND/RECV; `lower_comms` output is correct by construction (and tested to be)."""
    problems = _structure_problems(schedule)
    if not problems:
        problems = _compute_problems(schedule)
    if problems:
        _raise(schedule, problems)
    if not schedule.lowered:
        return lower_comms(schedule)
    problems = _p2p_problems(schedule)
    if problems:
        from schedules.graph import describe_cycle, find_cycle  # networkx, for the error only (85 ms of every start)

        cycle = find_cycle(schedule) if any("different orders" in p for p in problems) else None
        if cycle is not None:
            problems.append(f"deadlock: dependency cycle through ranks {sorted({r for r, _ in cycle})}: "
                            f"{describe_cycle(schedule, cycle)}")
        _raise(schedule, problems)
    return schedule


def raise_deadlock(lowered: Schedule, blocked: dict) -> None:
    from schedules.graph import describe_cycle, find_cycle  # networkx, for the error only (85 ms of every start)

    cycle = find_cycle(lowered)
    if cycle is not None:
        ranks = sorted({r for r, _ in cycle})
        problem = f"deadlock: dependency cycle through ranks {ranks}: {describe_cycle(lowered, cycle)}"
    else:
        stuck = ", ".join(f"rank {r} at {a}" for r, a in sorted(blocked.items()))
        problem = f"deadlock: ranks stop making progress ({stuck})"
    _raise(lowered, [problem])


def _raise(schedule: Schedule, problems: list[str]) -> None:
    shown = problems[:MAX_REPORTED]
    more = f"\n  ... and {len(problems) - MAX_REPORTED} more" if len(problems) > MAX_REPORTED else ""
    raise ScheduleError(f"invalid {schedule.kind} schedule ({schedule.num_ranks} ranks, "
                        f"{schedule.num_microbatches} micro-batches):\n  " + "\n  ".join(shown) + more)
