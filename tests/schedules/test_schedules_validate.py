"""Validation rejects broken schedules with the rule, the ranks and the actions; deadlocks show the cycle."""
import pytest

from schedules import Action, Kind, ScheduleError, build, lower_comms, validate_schedule
from schedules.graph import dependency_graph, find_cycle


def _replace_rank(schedule, rank, acts):
    actions = list(schedule.actions)
    actions[rank] = tuple(acts)
    return schedule.with_actions(tuple(actions))


def test_two_sends_reordered_is_a_deadlock_with_the_cycle_shown():
    s = lower_comms(build("1f1b", 2, 4))
    acts = list(s.actions[0])
    i1 = acts.index(Action(Kind.SEND_F, 0, 1, peer=1))
    i2 = acts.index(Action(Kind.SEND_F, 0, 2, peer=1))
    acts[i1], acts[i2] = acts[i2], acts[i1]
    broken = _replace_rank(s, 0, acts)
    with pytest.raises(ScheduleError) as err:
        validate_schedule(broken)
    msg = str(err.value)
    assert "cycle" in msg and "rank 0" in msg and "SEND_F" in msg
    assert find_cycle(broken) is not None


def test_sends_in_a_different_order_than_receives_is_rejected():
    """Both producers done before either send: the order on the channel differs between the two sides."""
    s = lower_comms(build("gpipe", 2, 3))
    acts = [a for a in s.actions[0] if a.kind is not Kind.SEND_F]
    last_f = max(i for i, a in enumerate(acts) if a.kind is Kind.F)
    sends = [Action(Kind.SEND_F, 0, m, peer=1) for m in (1, 0, 2)]
    broken = _replace_rank(s, 0, acts[: last_f + 1] + sends + acts[last_f + 1:])
    with pytest.raises(ScheduleError, match="different orders") as err:
        validate_schedule(broken)
    assert "cycle" in str(err.value)


@pytest.mark.parametrize("mutate, rule", [
    (lambda acts: [a for a in acts if a.kind is not Kind.W or a.mb != 1], "I x1, W x0"),
    (lambda acts: acts + [Action(Kind.F, 1, 0)], "2 forwards"),
    (lambda acts: _move_first(acts, Kind.W, before=Kind.I), "comes before its I"),
    (lambda acts: [Action(Kind.F, 0, 0)] + acts, "placed on rank 0"),
    (lambda acts: acts + [Action(Kind.F, 1, 99)], "micro-batch in 0.."),
])
def test_compute_rules(mutate, rule):
    s = build("zb1p", 2, 4)
    broken = _replace_rank(s, 1, mutate(list(s.actions[1])))
    with pytest.raises(ScheduleError, match=rule):
        validate_schedule(broken)


def _move_first(acts, kind, before):
    i = next(i for i, a in enumerate(acts) if a.kind is kind)
    j = next(j for j, a in enumerate(acts) if a.kind is before and a.mb == acts[i].mb)
    moved = acts.pop(i)
    acts.insert(j, moved)
    return acts


def test_backward_before_forward_on_the_v_bottom():
    """DualPipeV's stages P-1 and P share a rank: F of stage P before F of stage P-1 is caught locally."""
    s = build("dualpipev", 2, 4)
    acts = list(s.actions[1])
    i = acts.index(Action(Kind.F, 2, 0))
    j = acts.index(Action(Kind.F, 1, 0))
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(ScheduleError, match="F of stage 2 mb 0 runs before F of stage 1"):
        validate_schedule(_replace_rank(s, 1, acts))


def test_missing_and_extra_p2p():
    s = lower_comms(build("1f1b", 2, 3))
    acts = [a for a in s.actions[1] if a != Action(Kind.RECV_F, 0, 2, peer=0)]
    with pytest.raises(ScheduleError, match="missing RECV_F"):
        validate_schedule(_replace_rank(s, 1, acts))
    extra = list(s.actions[1]) + [Action(Kind.RECV_F, 0, 2, peer=0)]
    with pytest.raises(ScheduleError, match="extra or duplicated"):
        validate_schedule(_replace_rank(s, 1, extra))


def test_compute_reorder_deadlock_crosses_ranks():
    """Rank 0 waits for mb0's grad before computing mb1; rank 1 computes mb1's forward before mb0's backward."""
    s = build("1f1b", 2, 3)
    F, B = Kind.F, Kind.B
    broken = _replace_rank(s, 0, [Action(k, 0, m) for k, m in ((F, 0), (B, 0), (F, 1), (B, 1), (F, 2), (B, 2))])
    broken = _replace_rank(broken, 1, [Action(k, 1, m) for k, m in ((F, 0), (F, 1), (B, 0), (B, 1), (F, 2), (B, 2))])
    with pytest.raises(ScheduleError, match=r"deadlock: dependency cycle through ranks \[0, 1\]") as err:
        validate_schedule(broken)
    assert "rank 0: B/s0/mb0" in str(err.value) and "rank 1: F/s1/mb1" in str(err.value)


@pytest.mark.parametrize("kind, P, M", [("dualpipe", 4, 8), ("dualpipev", 4, 9), ("zb1p", 4, 5), ("1f1b", 3, 4)])
def test_valid_schedules_have_acyclic_graphs(kind, P, M):
    import networkx as nx

    g = dependency_graph(lower_comms(build(kind, P, M)))
    assert nx.is_directed_acyclic_graph(g)
