"""The process groups a layout makes, computed without a process group: what `layout.build_groups` creates and what
each rank joins (for `mhcpipe layout`, before a launch).

Shape letters: P pipeline ranks, D data-parallel replicas, EP expert-parallel degree, D_e = D / EP.

`build_groups` makes only the groups the runtime posts on: the P2P channels (one per direction of each pipeline link
and row), the forward and backward expert-parallel groups, the dense and expert gradient groups (the pipeline rows
instead of the channels under parallel.p2p_groups 'shared'). Groups come in families of disjoint rank sets (each
`family` below; the channels are four: per direction, the links from even and from odd pipeline ranks). On gloo
each group is one `new_group`, collective over the whole world, members or not; on NCCL one
`torch.distributed.split_group` of the world makes a whole family (layout.use_split). A set of the whole world is the
default group and sets of one rank make none. `tests/pipeline/test_pipeline_layout.py` checks the
plan against the groups a real (gloo) start-up makes.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.distributed.layout import Layout, channel_families


@dataclass(frozen=True)
class GroupSpec:
    name: str  # as the runtime names it (traces, the strict transport)
    members: tuple[int, ...]  # global ranks
    role: str  # world, pp, p2p, ep-F, ep-B, grad, grad-experts
    family: str = ""  # the creation that makes it with split_group (layout.make_groups' desc)


def _name(role: str, members) -> str:
    return f"{role}:{','.join(map(str, members))}"


def plan_groups(layout: Layout, p2p_groups: str = "channel") -> list[GroupSpec]:
    """Every group the start-up makes for `layout`, in creation order (see the module docstring)."""
    plan: list[GroupSpec] = []
    world = tuple(range(layout.world))

    def add(role: str, members, name: str | None = None, explicit: bool = False, family: str = "") -> None:
        members = tuple(members)
        # a set of the whole world is the default group; an explicit new_group is always a new one
        if len(members) < 2 or (members == world and plan and not explicit):
            return
        plan.append(GroupSpec(name or _name(role, members), members, role, family or role))

    P, D, EP = layout.pp, layout.dp, layout.ep
    add("world", world, name="world")
    if p2p_groups == "shared":
        for d in range(D):
            add("pp", [layout.rank(p, d) for p in range(P)])
    else:
        for desc, links in channel_families(layout):
            for d, src, dst in links:
                a, b = layout.rank(src, d), layout.rank(dst, d)
                add("p2p", sorted((a, b)), name=f"p2p:{a}>{b}", explicit=True, family=desc)
    if EP > 1:
        blocks = layout.expert_ranks().reshape(-1, EP).tolist()
        for side in ("F", "B"):
            for b in blocks:
                add(f"ep-{side}", b, name=_name(f"ep-{side}", b), explicit=True)
    if layout.mirrored:
        for row in layout.dense_grad_ranks().tolist():
            add("grad", row)
    elif D > 1:
        for p in range(P):
            add("grad", [layout.rank(p, d) for d in range(D)])
    copies = 2 * layout.edp if layout.mirrored else layout.edp
    if copies > 1 and EP > 1:
        sets = layout.expert_grad_ranks() if layout.mirrored else layout.expert_ranks().swapaxes(1, 2)
        for s in sets.reshape(-1, copies).tolist():
            add("grad-experts", s)
    return plan


def world_wide_creations(plan: list[GroupSpec], split: bool) -> int:
    """Creations collective over the whole world at start-up: one per group (new_group), or one per family
    (split_group); the world group exists before."""
    made = plan[1:]
    return len({g.family for g in made}) if split else len(made)


def groups_of(plan: list[GroupSpec], rank: int) -> list[GroupSpec]:
    return [g for g in plan if rank in g.members]


def warmup_order(items: list, name=lambda g: g.name) -> list:
    """`items` (groups, or anything with a group name) in the order the warm-up connects them
    (pipeline.distributed.warmup): by name, the same string on every member."""
    return sorted(items, key=name)
