"""Tied parameters across pipeline stages: who holds a copy, the group that sums their gradients, and when.

A user model's parameter may be held by pieces on different stages (pipeline.user_model.Tie: an output
projection tied to the token embedding sits on the first and the last stage). Every rank whose stages hold one of
its pieces keeps a copy (built identically under the run's seed). As Megatron does for its shared embedding,
the copies' gradients are summed over their holders before the optimizer: each copy's gradient holds the uses on
that rank (a rank with two holding stages, DualPipeV's rank 0, accumulates both into its one copy), so the sum
over all holding ranks (every data-parallel replica and DualPipe's mirrored copies included) is the gradient of
the whole step. One all-reduce gives every member the same sum, bitwise (ring and tree algorithms end by
broadcasting the reduced values), so equal copies with equal optimizer states stay equal.

Holders are read off the rank plans (every rank knows every rank's stages), so every rank computes the same
holder sets in the same order: one group per distinct set, made collectively at start-up (`make_tie_groups`),
named `tie:<ranks>`; a set that is exactly this rank's dense gradient group reuses it. A set of one rank needs no
sum. The all-reduces are posted by pipeline.distributed.grad_reduce after the step's other gradient reductions
(its `finish`), the same point on every member, which is all NCCL asks of a group's order.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.distributed.layout import Layout, make_groups


@dataclass(frozen=True)
class TieSet:
    """Tied parameters (their names) whose copies the same ranks (`ranks`, global) hold."""

    names: tuple[str, ...]
    ranks: tuple[int, ...]

    @property
    def label(self) -> str:
        return "tie:" + ",".join(map(str, self.ranks))


def tie_sets(ties, stages, layout: Layout) -> list[TieSet]:
    """Holder sets of `ties` (pipeline.user_model.Tie) over every stage of the plan (`stages`: StageSpec, each with
    its pipeline rank) and every data-parallel replica, in the order of the ties' names; sets of one rank left
    out (nothing to sum)."""
    by_ranks: dict[tuple[int, ...], list[str]] = {}
    for tie in sorted(ties, key=lambda t: t.name):
        pp = sorted({sp.rank for sp in stages if sp.pieces & set(tie.pieces)})
        ranks = tuple(sorted(layout.rank(p, d) for p in pp for d in range(layout.dp)))
        if len(ranks) > 1:
            by_ranks.setdefault(ranks, []).append(tie.name)
    return [TieSet(tuple(names), ranks) for ranks, names in by_ranks.items()]


def dense_sets(layout: Layout) -> set[tuple[int, ...]]:
    """The member sets of the layout's dense gradient groups (pipeline.distributed.layout.build_groups)."""
    if layout.mirrored:
        rows = layout.dense_grad_ranks().tolist()
    else:
        rows = [[layout.rank(p, d) for d in range(layout.dp)] for p in range(layout.pp)]
    return {tuple(sorted(r)) for r in rows if len(r) > 1}


def join_tie_groups(ties, stages, groups) -> list[TieSet]:
    """The holder sets of a user model's `ties` over the plan's `stages`, their groups made (collective) and
    registered in `groups` (pipeline.distributed.layout.ParallelGroups: tie_groups, names); [] when nothing is
    held by two ranks."""
    sets = tie_sets(ties, stages, groups.layout)
    if not sets:
        return []
    if groups.world_group is None:
        raise ValueError(f"tied parameters {', '.join(n for s in sets for n in s.names)} are held by several "
                         "ranks: a run without a process group cannot sum their gradients")
    made = make_tie_groups(sets, groups.layout, groups.rank, groups.dense_grad_group, groups.timeout_s)
    groups.tie_groups.update(made)
    for label, g in made.items():
        groups.names.setdefault(id(g), label)
    return sets


def make_tie_groups(sets: list[TieSet], layout: Layout, rank: int, dense_grad_group,
                    timeout_s: float | None) -> dict[str, object]:
    """{label: this rank's group} for the sets it is in (collective: every rank calls it with the same sets, and
    whether a set reuses a dense gradient group is read off the layout, so every rank makes the same creations).
    `timeout_s`: the new groups' timeout, as the world's (pipeline.distributed.p2p.process_group_timeout_s)."""
    import datetime

    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
    reusable = dense_sets(layout)
    out = {}
    for s in sets:
        if s.ranks in reusable:
            if rank in s.ranks:
                out[s.label] = dense_grad_group
            continue
        group = make_groups([list(s.ranks)], s.label, split=False, timeout=timeout)  # collective over the world
        if group is not None:
            out[s.label] = group
    return out
