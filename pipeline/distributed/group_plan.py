"""The process groups a layout makes, computed without a process group: what `layout.build_groups` creates, which
of them the runtime uses, and what each rank joins (for `mhcpipe layout`, before a launch).

Shape letters: P pipeline ranks, D data-parallel replicas, EP expert-parallel degree, D_e = D / EP.

`build_groups` creates its groups from DeviceMeshes, whose every dimension is a set of groups (one per fixed value
of the other dimensions), plus explicit ones: the P2P channels (one per direction of each pipeline link and row) and
the backward expert-parallel groups. Every creation is collective over the whole world (a `new_group`, or a split of
the world's communicator on NCCL), members or not, and makes a new group even where another mesh already has one of
the same ranks; a mesh dimension that spans the whole world is the world group. Groups of one rank (a dimension of
size 1) are left out: they carry no traffic. `tests/pipeline/test_pipeline_layout.py` checks the plan
against the groups a real (gloo) start-up makes.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.distributed.layout import Layout


@dataclass(frozen=True)
class GroupSpec:
    name: str  # as the runtime names it (traces, the strict transport); mesh groups it never uses: role:members
    members: tuple[int, ...]  # global ranks
    role: str  # world, pp, dp, p2p, ep-F, ep-B, grad, grad-experts, or the mesh dimension of an unused group
    used: bool  # does the runtime post anything on it?


def _name(role: str, members) -> str:
    return f"{role}:{','.join(map(str, members))}"


def plan_groups(layout: Layout, p2p_groups: str = "channel") -> list[GroupSpec]:
    """Every group `build_groups` makes for `layout`, in creation order (see the module docstring)."""
    plan: list[GroupSpec] = []
    world = tuple(range(layout.world))

    def add(role: str, members, used: bool, name: str | None = None, explicit: bool = False) -> None:
        members = tuple(members)
        # a mesh dimension over the whole world is the world group; an explicit new_group is always a new one
        if len(members) < 2 or (members == world and plan and not explicit):
            return
        plan.append(GroupSpec(name or _name(role, members), members, role, used))

    P, D, EP = layout.pp, layout.dp, layout.ep
    add("world", world, True, name="world")
    shared = p2p_groups == "shared"
    dense_on_dp = not layout.mirrored and D > 1
    copies = 2 * layout.edp if layout.mirrored else layout.edp
    for d in range(D):  # the (pp, dp) mesh: its pp dimension, then its dp dimension
        add("pp", [layout.rank(p, d) for p in range(P)], shared)
    for p in range(P):
        add("grad" if dense_on_dp else "dp", [layout.rank(p, d) for d in range(D)], dense_on_dp)
    if not shared:
        for d in range(D):
            for p in range(P - 1):
                for src, dst in ((p, p + 1), (p + 1, p)):
                    a, b = layout.rank(src, d), layout.rank(dst, d)
                    add("p2p", (a, b), True, name=f"p2p:{a}>{b}", explicit=True)
    if EP > 1:
        ranks = layout.expert_ranks().tolist()  # [P][D_e][EP]
        expert_grad_on_edp = not layout.mirrored and copies > 1
        for k in range(layout.edp):
            for e in range(EP):
                add("pp", [ranks[p][k][e] for p in range(P)], False)
        for p in range(P):
            for e in range(EP):
                add("grad-experts" if expert_grad_on_edp else "edp", [ranks[p][k][e] for k in range(layout.edp)],
                    expert_grad_on_edp)
        for p in range(P):
            for k in range(layout.edp):
                add("ep-F", ranks[p][k], True, name=_name("ep-F", ranks[p][k]))
        for p in range(P):
            for k in range(layout.edp):
                add("ep-B", ranks[p][k], True, name=_name("ep-B", ranks[p][k]), explicit=True)
    if layout.mirrored:
        dense = layout.dense_grad_ranks().tolist()  # [P/2][2D]
        for j in range(len(dense[0])):
            add("holders", [row[j] for row in dense], False)
        for row in dense:
            add("grad", row, True)
        if EP > 1 and copies > 1:
            xr = layout.expert_grad_ranks().tolist()  # [P/2][EP][2 D_e]
            for e in range(EP):
                for j in range(len(xr[0][0])):
                    add("holders", [xr[h][e][j] for h in range(len(xr))], False)
            for h in range(len(xr)):
                for j in range(len(xr[0][0])):
                    add("ep", [xr[h][e][j] for e in range(EP)], False)
            for h in range(len(xr)):
                for e in range(EP):
                    add("grad-experts", xr[h][e], True)
    return plan


def groups_of(plan: list[GroupSpec], rank: int) -> list[GroupSpec]:
    return [g for g in plan if rank in g.members]
