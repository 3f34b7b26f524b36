"""Generators: every kind validates over a grid of (P, M); impossible requests fail with the rule named;
DualPipe(V) follow the reference's per-step counts; DualPipeV equals torch's ScheduleDualPipeV."""
from collections import Counter

import pytest

from schedules import names, Kind, build, validate_schedule
from schedules.dualpipev import dualpipev

RANKS = (2, 4, 8, 16)


def valid_microbatches(kind: str, P: int) -> list[int]:
    low = {"gpipe": 1, "1f1b": P, "zb1p": P, "dualpipe": 2 * P, "dualpipev": 2 * P}[kind]
    choices = [low, low + 2, 2 * low + 4]
    return [m + (m % 2) if kind == "dualpipe" else m for m in choices]


@pytest.mark.parametrize("kind", names())
@pytest.mark.parametrize("P", RANKS)
def test_every_kind_validates(kind, P):
    for M in valid_microbatches(kind, P):
        validate_schedule(build(kind, P, M))


@pytest.mark.parametrize("kind, P, M, rule", [
    ("dualpipe", 3, 12, "even number of ranks"),
    ("dualpipe", 4, 6, "microbatches >= 2 x ranks"),
    ("dualpipe", 4, 9, "even number of micro-batches"),
    ("dualpipev", 4, 7, "microbatches >= 2 x ranks"),
    ("1f1b", 4, 3, "microbatches >= ranks"),
    ("zb1p", 8, 7, "microbatches >= ranks"),
    ("gpipe", 0, 4, "positive"),
    ("1f1b", 4, 0, "positive"),
    ("dualpipev", -2, 8, "positive"),
])
def test_invalid_requests_name_the_rule(kind, P, M, rule):
    with pytest.raises(ValueError, match=rule):
        build(kind, P, M)


def test_unknown_kind_lists_valid_names():
    with pytest.raises(ValueError, match="dualpipev"):
        build("interleaved", 4, 8)


def _step_counts(P: int, M: int, r: int, dualpipe: bool) -> dict[str, int]:
    """schedules.md §2 table: per-rank iterations of each of the eight steps."""
    H, h, C = (P // 2, min(r, P - 1 - r), M // 2) if dualpipe else (P, r, M)
    return {"s1": 2 * (H - h - 1), "s2": h + 1, "s3": H - h - 1, "s4": C - 2 * H + h + 1, "s5": H - h - 1,
            "s6": h + 1, "s7": H - h - 1, "s8": h + 1}


@pytest.mark.parametrize("kind, P, M", [("dualpipev", 4, 10), ("dualpipev", 8, 20), ("dualpipe", 8, 20),
                                        ("dualpipe", 4, 12)])
def test_dualpipe_counts_follow_the_eight_steps(kind, P, M):
    s = build(kind, P, M)
    for r, acts in enumerate(s.actions):
        c = _step_counts(P, M, r, kind == "dualpipe")
        kinds = Counter(a.kind for a in acts)
        first_pair_split = (kind == "dualpipev" and r == P - 1) or (kind == "dualpipe" and r in (P // 2 - 1, P // 2))
        # overlapped pairs: all of step 4 (minus a split first pair) plus step 5
        assert kinds[Kind.FB] == 2 * c["s4"] - first_pair_split + c["s5"]
        # split backwards (each followed by exactly one W): steps 3 and 7 plus h+1 of step 6
        assert kinds[Kind.I] == kinds[Kind.W] == c["s3"] + c["s7"] + c["s6"]
        # every chunk runs C forwards and C backwards
        C = M // 2 if kind == "dualpipe" else M
        for stage in s.stages_of(r):
            f = sum(1 for a in acts for p in a.parts() if p.kind is Kind.F and p.stage == stage)
            b = sum(1 for a in acts for p in a.parts() if p.kind in (Kind.B, Kind.I) and p.stage == stage)
            assert f == b == C


def test_worked_counts_dualpipev_4_10():
    """schedules.md §2 worked example: rank 0 splits 7 backwards, rank 3 splits 4."""
    s = dualpipev(4, 10)
    assert sum(a.kind is Kind.W for a in s.actions[0]) == 7
    assert sum(a.kind is Kind.W for a in s.actions[3]) == 4


def _torch_dualpipev(P: int, M: int) -> list[list[str]]:
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    return [[str(a) for a in rank if a is not None] for rank in get_schedule_ops("DualPipeV", P, M)]


@pytest.mark.parametrize("P, M", [(1, 2), (2, 4), (2, 7), (4, 8), (4, 10), (4, 13), (8, 16), (8, 20)])
def test_dualpipev_equals_torch_schedule(P, M):
    """torch's ScheduleDualPipeV is the oracle: the same per-rank compute order, action by action."""
    ours = [[str_of(a) for a in acts] for acts in dualpipev(P, M).actions]
    assert ours == _torch_dualpipev(P, M)


def str_of(a) -> str:
    from schedules.ir import to_torch_str

    return to_torch_str(a)


def test_stage_placement():
    assert build("dualpipev", 4, 8).stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    assert build("dualpipe", 4, 8).stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    assert build("dualpipe", 4, 8).pipelines == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert build("dualpipev", 4, 8).pipelines == (tuple(range(8)),)
    assert build("1f1b", 4, 8).stage_to_rank == (0, 1, 2, 3)
