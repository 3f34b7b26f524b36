"""The process groups a layout makes, computed without a process group: what `layout.build_groups` creates and what
each rank joins (for `mhcpipe layout`, before a launch).

Shape letters: P pipeline ranks, D data-parallel replicas, EP expert-parallel degree, D_e = D / EP.

`build_groups` makes only the groups the runtime posts on: the P2P channels (one per direction of each pipeline link
and row), the forward and backward expert-parallel groups, the dense and expert gradient groups (the pipeline rows
instead of the channels under parallel.p2p_groups 'shared'). Every creation is collective over the whole world (a
`new_group`, or a split of the world's communicator on NCCL), members or not, and makes a new group; a set of the
whole world is the default group and sets of one rank make none. `tests/pipeline/test_pipeline_layout.py` checks the
plan against the groups a real (gloo) start-up makes.

`plan_groups(layout, dense_meshes=True)` instead lists what the multi-dimensional DeviceMeshes of earlier versions
made (every dimension of every mesh, most never posted on; a rank set a second mesh repeats was a group of its own):
the before that `mhcpipe layout` prints beside the plan.
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


def plan_groups(layout: Layout, p2p_groups: str = "channel", dense_meshes: bool = False) -> list[GroupSpec]:
    """Every group the start-up makes for `layout`, in creation order (see the module docstring)."""
    plan: list[GroupSpec] = []
    world = tuple(range(layout.world))

    def add(role: str, members, used: bool = True, name: str | None = None, explicit: bool = False) -> None:
        members = tuple(members)
        # a set of the whole world is the default group; an explicit new_group is always a new one
        if len(members) < 2 or (members == world and plan and not explicit):
            return
        plan.append(GroupSpec(name or _name(role, members), members, role, used))

    P, D, EP = layout.pp, layout.dp, layout.ep
    add("world", world, name="world")
    shared = p2p_groups == "shared"
    copies = 2 * layout.edp if layout.mirrored else layout.edp
    rows = [[layout.rank(p, d) for p in range(P)] for d in range(D)]  # a pipeline row per replica
    replicas = [[layout.rank(p, d) for d in range(D)] for p in range(P)]  # a pipeline rank's replicas
    if dense_meshes:
        _dense_mesh_extras(layout, add, rows, replicas, shared, copies)
    elif shared:
        for row in rows:
            add("pp", row)
    if not shared:
        for d in range(D):
            for p in range(P - 1):
                for src, dst in ((p, p + 1), (p + 1, p)):
                    a, b = layout.rank(src, d), layout.rank(dst, d)
                    add("p2p", (a, b), name=f"p2p:{a}>{b}", explicit=True)
    if EP > 1:
        blocks = layout.expert_ranks().reshape(-1, EP).tolist()
        for side in ("F", "B"):
            if dense_meshes and side == "F":
                continue  # the expert mesh made them (_dense_mesh_extras)
            for b in blocks:
                add(f"ep-{side}", b, name=_name(f"ep-{side}", b), explicit=True)
    if layout.mirrored and not dense_meshes:
        for row in layout.dense_grad_ranks().tolist():
            add("grad", row)
    elif D > 1 and not dense_meshes:
        for rep in replicas:
            add("grad", rep)
    if copies > 1 and EP > 1 and not dense_meshes:
        sets = layout.expert_grad_ranks() if layout.mirrored else layout.expert_ranks().transpose(1, 2)
        for s in sets.reshape(-1, copies).tolist():
            add("grad-experts", s)
    return plan


def _dense_mesh_extras(layout: Layout, add, rows, replicas, shared: bool, copies: int) -> None:
    """The groups of the earlier multi-dimensional meshes, every dimension, in their order: (pp, dp), then (pp, edp,
    ep) with the expert groups, then DualPipe's (holders, grad) and (holders, ep, grad)."""
    P, D, EP = layout.pp, layout.dp, layout.ep
    dense_on_dp = not layout.mirrored and D > 1
    for row in rows:
        add("pp", row, shared)
    for rep in replicas:
        add("grad" if dense_on_dp else "dp", rep, dense_on_dp)
    if EP > 1:
        ranks = layout.expert_ranks().tolist()  # [P][D_e][EP]
        edp_used = not layout.mirrored and copies > 1
        for k in range(layout.edp):
            for e in range(EP):
                add("pp", [ranks[p][k][e] for p in range(P)], False)
        for p in range(P):
            for e in range(EP):
                add("grad-experts" if edp_used else "edp", [ranks[p][k][e] for k in range(layout.edp)], edp_used)
        for p in range(P):
            for k in range(layout.edp):
                add("ep-F", ranks[p][k], name=_name("ep-F", ranks[p][k]))
    if layout.mirrored:
        dense = layout.dense_grad_ranks().tolist()  # [P/2][2D]
        for j in range(len(dense[0])):
            add("holders", [row[j] for row in dense], False)
        for row in dense:
            add("grad", row)
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
                    add("grad-experts", xr[h][e])


def groups_of(plan: list[GroupSpec], rank: int) -> list[GroupSpec]:
    return [g for g in plan if rank in g.members]
