"""The parallel layout of a run on a DeviceMesh: pipeline ranks (pp) x data-parallel replicas (dp), with
expert-parallel groups inside dp, as Megatron and DeepSeek place them.

Shape letters: P pipeline ranks, D data-parallel replicas, EP expert-parallel ranks, D_e = D / EP replicas of
one expert.

World = P x D processes, row-major on the mesh: global rank = pp_rank * D + dp_rank, so the replicas of one
pipeline rank are consecutive (one node: its NVLink carries their all-to-all and gradient all-reduce, while the
pipeline's P2P crosses nodes). EP cuts dp into D / EP blocks of EP consecutive ranks: dp_rank = edp_rank * EP +
ep_rank. An EP group exchanges tokens; the ranks with the same pp and ep rank (the edp group) hold the same
experts.

Process groups, created collectively on every rank, each dimension the runtime posts on as a one-dimensional
DeviceMesh (a multi-dimensional mesh would also make every other dimension's groups, which nothing uses), passed in:
* the P2P channels: one two-rank group per direction of each link of a pipeline row (`p2p:<src>><dst>`, global
  ranks), so a communicator only ever carries one channel's messages, in one order on both ends
  (docs/communication.md says why that cannot deadlock under NCCL's rules);
* the EP group of the all-to-all (`ep-F`), and a second group over the same ranks for the backward's all-to-alls
  (`ep-B`, pipeline.distributed.expert);
* gradient groups, the ranks that sum one stage's gradients: dense parameters over dp, expert parameters over
  edp. DualPipe holds every model chunk on two pipeline ranks (r and P-1-r), so its groups also span the
  mirrored rank: DeepSeek's reduction of the duplicated copies and data parallelism are one all-reduce
  (the rank sets of `dense_grad_ranks` and `expert_grad_ranks`).
The world group (loss, statistics, barriers) is the default group, taken once here and passed on.

Multi-node is torchrun's rendezvous: every node runs the same command with --nnodes, --node-rank (or
--rdzv-backend c10d --rdzv-endpoint HOST:PORT) and --nproc-per-node; the mesh is laid over the global ranks.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the type of every `cfg` here; configs is imported where it is used
    from configs import RunConfig

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

from dataclasses import dataclass, field

import numpy as np



class MeshAxis(enum.StrEnum):
    """The dimension names of the runtime's DeviceMeshes (the same strings torch sees)."""

    PP = "pp"  # pipeline ranks
    DP = "dp"  # data-parallel replicas
    EDP = "edp"  # the replicas that hold the same experts (dp / ep)
    EP = "ep"  # expert-parallel ranks inside a replica group
    HOLDERS = "holders"  # the ranks whose copies of one parameter are reduced together
    GRAD = "grad"  # the gradient-reduction group of those copies

@dataclass(frozen=True)
class Layout:
    pp: int  # pipeline ranks P
    dp: int  # data-parallel replicas D
    ep: int  # expert-parallel degree EP (divides D)
    schedule: str

    @property
    def world(self) -> int:
        return self.pp * self.dp

    @property
    def edp(self) -> int:
        return self.dp // self.ep

    @property
    def mirrored(self) -> bool:
        """DualPipe: pipeline ranks r and P-1-r hold the same model chunks."""
        from schedules.registry import kind_of

        return kind_of(self.schedule).mirrors

    def rank(self, pp_rank: int, dp_rank: int) -> int:
        return pp_rank * self.dp + dp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        """(pp_rank, dp_rank) of a global rank."""
        return divmod(rank, self.dp)

    @classmethod
    def of(cls, cfg: RunConfig) -> "Layout":
        par = cfg.parallel
        return cls(par.ranks, par.data_parallel, par.expert_parallel, par.schedule)

    def check(self, cfg: RunConfig, world: int | None = None) -> None:
        """One-line errors naming the field and flag, before any process group exists."""
        if world is not None and world != self.world:
            raise ValueError(f"parallel.ranks (--pp {self.pp}) x parallel.data_parallel (--dp {self.dp}) = "
                             f"{self.world}, but {world} processes were started (torchrun --nproc-per-node x "
                             "--nnodes); make them equal")
        moe = cfg.model.moe
        if self.ep > 1 and moe is None:
            raise ValueError(f"parallel.expert_parallel (--ep {self.ep}): model {cfg.model.name!r} has no MoE "
                             "(model.moe) to split over experts; use --ep 1")
        if moe is not None and moe.num_experts % self.ep:
            raise ValueError(f"parallel.expert_parallel (--ep {self.ep}) must divide model.moe.num_experts="
                             f"{moe.num_experts}")

    # -- rank arrays of the meshes (numpy: `mhcpipe layout` plans the groups without importing torch) ----------
    def expert_ranks(self) -> np.ndarray:
        """[P, D_e, EP] global ranks."""
        return np.arange(self.world).reshape(self.pp, self.edp, self.ep)

    def _holders(self) -> list[list[int]]:
        """Pipeline ranks holding the same chunks: [[r, P-1-r]] (DualPipe) or [[r]]."""
        if not self.mirrored:
            return [[r] for r in range(self.pp)]
        return [[r, self.pp - 1 - r] for r in range(self.pp // 2)]

    def dense_grad_ranks(self) -> np.ndarray:
        """[holder sets, |set| x D]: the ranks that sum one stage's dense gradients."""
        return np.array([[self.rank(p, d) for p in ps for d in range(self.dp)] for ps in self._holders()])

    def expert_grad_ranks(self) -> np.ndarray:
        """[holder sets, EP, |set| x D_e]: the ranks that sum one expert's gradients."""
        return np.array([[[self.rank(p, k * self.ep + e) for p in ps for k in range(self.edp)]
                              for e in range(self.ep)] for ps in self._holders()])


@dataclass
class ParallelGroups:
    """This rank's place in the layout and its process groups (None where the group would be this rank alone).
    `names`: id(group) -> the group's name (the same string on all its members, one per communicator), which
    trace spans and the strict transport's messages carry."""

    layout: Layout
    rank: int  # global rank
    pp_rank: int
    dp_rank: int
    ep_rank: int
    pp_group: dist.ProcessGroup | None = None  # the pipeline row's group, made for p2p_groups 'shared' only
    ep_groups: dict | None = None  # "F" / "B": the EP ranks, one group for forward and one for backward exchanges
    dense_grad_group: dist.ProcessGroup | None = None
    dense_grad_size: int = 1
    expert_grad_group: dist.ProcessGroup | None = None
    expert_grad_size: int = 1
    world_group: dist.ProcessGroup | None = None
    meshes: tuple = ()
    p2p_channels: dict | None = None  # (src pp rank, dst pp rank) -> its one-direction group, this rank's row
    names: dict = field(default_factory=dict)
    tie_groups: dict = field(default_factory=dict)  # tie label -> group: a user model's tied parameters' holders
    timeout_s: float | None = None  # every group's timeout (as the world's), for groups made later (tie groups)

    def comm_groups(self) -> dict[str, list[int]]:
        """{name: global ranks} of this rank's named groups (trace meta `comm_groups`, traces.analysis.comm_replay)."""
        import torch.distributed as dist

        out = {}
        for g in (self.world_group, self.pp_group, self.dense_grad_group, self.expert_grad_group,
                  *(self.ep_groups or {}).values(), *(self.p2p_channels or {}).values(), *self.tie_groups.values()):
            if g is not None and id(g) in self.names:
                out[self.names[id(g)]] = dist.get_process_group_ranks(g)
        return out

    def name_of(self, group) -> str:
        """The group's name; `world` for the default group."""
        name = self.names.get(id(group))
        if name is None:
            return "world" if group is None or group is self.world_group else f"group{id(group):x}"
        return name

    def channel(self, src: int, dst: int):
        """The process group of the P2P channel pipeline rank `src` -> `dst` of this rank's row (the shared `pp`
        group under parallel.p2p_groups 'shared')."""
        if self.p2p_channels is None:
            return self.pp_group
        group = self.p2p_channels.get((src, dst))
        if group is None:
            raise ValueError(f"rank {self.rank}: no P2P channel group for pipeline ranks {src} -> {dst} (only "
                             f"neighbouring ranks exchange activations: {sorted(self.p2p_channels)})")
        return group

    @classmethod
    def single(cls, layout: Layout, pp_rank: int) -> "ParallelGroups":
        """No process group (a stage benchmark with a loopback transport): one replica, no EP."""
        return cls(layout, pp_rank, pp_rank, 0, 0)


def _members(group) -> str:
    import torch.distributed as dist

    return ",".join(map(str, dist.get_process_group_ranks(group)))


def use_split(env=None) -> bool:
    """Make groups with `torch.distributed.split_group` (one split of the world's communicator makes every set of a
    disjoint family at once) rather than one `new_group` per set (each a world-wide creation, members or not)? Only
    on NCCL (split_group supports no other backend), where torch has it, and unless MHCPIPE_SPLIT_GROUPS=0."""
    import os

    import torch.distributed as dist

    env = os.environ if env is None else env
    return (env.get("MHCPIPE_SPLIT_GROUPS", "1") != "0" and hasattr(dist, "split_group")
            and dist.get_backend() == "nccl")


def make_groups(sets: list[list[int]], desc: str, split: bool, timeout=None):
    """This rank's group among `sets` (disjoint lists of global ranks; every rank calls this, in the same order),
    or None when it is in none. split: one `split_group` of the world for the whole family; else one `new_group`
    per set. `timeout` (a timedelta): the group's own, like the world's (pipeline.distributed.p2p
    .process_group_timeout_s); without it torch gives a subgroup its default (10 minutes on NCCL), under which
    NCCL's watchdog would abort a slow first step before the step deadline's one-line error."""
    import inspect

    import torch.distributed as dist

    from pipeline.distributed.errors import PipelineError, describe

    extra = {"timeout": timeout} if timeout is not None else {}
    if split:
        try:
            # group_desc names the family in Flight Recorder's dumps; an older split_group may not take it
            params = inspect.signature(dist.split_group).parameters
            if "group_desc" in params:
                extra["group_desc"] = desc
            if "timeout" not in params:
                extra.pop("timeout", None)
            return dist.split_group(split_ranks=sets, **extra)
        except Exception as err:  # noqa: BLE001 - backend errors have no common type
            raise PipelineError(f"creating the {desc} groups with torch.distributed.split_group failed: "
                                f"{describe(err)}; MHCPIPE_SPLIT_GROUPS=0 makes them with new_group") from None
    mine = None
    for members in sets:
        group = dist.new_group(members, group_desc=desc, **extra)  # collective: every rank calls it, members or not
        if dist.get_rank() in members:
            mine = group
    return mine


def channel_families(layout: Layout) -> list[tuple[str, list[tuple[int, int, int]]]]:
    """The P2P channels as four families of disjoint links, (description, [(d, src pp rank, dst pp rank)]): per
    direction, the links that start at an even and at an odd pipeline rank. One family is one creation."""
    out = []
    for direction in ("down", "up"):
        for parity in (0, 1):
            links = [(d, p, p + 1) if direction == "down" else (d, p + 1, p)
                     for d in range(layout.dp) for p in range(parity, layout.pp - 1, 2)]
            if links:
                out.append((f"p2p-{direction}-{'even' if parity == 0 else 'odd'}", links))
    return out


def build_p2p_channels(layout: Layout, rank: int, split: bool = False, timeout=None) -> tuple[dict, dict]:
    """One two-rank process group per direction of every link between neighbouring pipeline ranks, for every
    pipeline row: created on every rank in the same order (each creation is collective over the world), so each
    is one communicator on both of its members. Neighbours are the only pipeline ranks that exchange activations in
    the five schedules (a V's turn is a local hand-off). Returns this rank's row as {(src pp rank, dst pp rank):
    group} and {id(group): name}."""
    mine, names = {}, {}
    for desc, links in channel_families(layout):
        group = make_groups([sorted((layout.rank(src, d), layout.rank(dst, d))) for d, src, dst in links], desc, split,
                            timeout)
        for d, src, dst in links:
            a, b = layout.rank(src, d), layout.rank(dst, d)
            if rank in (a, b):
                mine[(src, dst)] = group
                names[id(group)] = f"p2p:{a}>{b}"
    return mine, names


def _dimension(sets: list[list[int]], axis: MeshAxis, device_type: str, meshes: list, new: bool = False,
               split: bool = False, desc: str | None = None, timeout=None):
    """This rank's group among `sets` (disjoint rank lists that cover the world), as a one-dimensional DeviceMesh (kept
    in `meshes`): one creation per set (new_group), or one for all (split). A set of the whole world is the
    default group unless `new` (a group that must differ from every other); sets of one rank make none (None).
    Only the dimensions the runtime posts on are made: a multi-dimensional mesh would make every dimension's
    groups, most of them never used (mhcpipe layout counts them)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if len(sets[0]) < 2:
        return None
    if len(sets) == 1 and len(sets[0]) == dist.get_world_size() and not new:
        group = dist.group.WORLD
    else:
        group = make_groups(sets, desc or axis.value, split, timeout)
    meshes.append(DeviceMesh.from_group(group, device_type, mesh_dim_names=(axis.value,)))
    return group


def build_groups(layout: Layout, rank: int, device_type: str, p2p_groups: str = "channel",
                 timeout_s: float | None = None) -> ParallelGroups:
    """Create the groups the runtime posts on (collective: every rank of the world calls it, in the same order).
    `p2p_groups`: 'channel' (one group per direction of each pipeline link) or 'shared' (each pipeline row's one
    group for all P2P: reproduces the design that deadlocks under NCCL's rules). `timeout_s`: every group's
    timeout, as the world's. pipeline.distributed.group_plan lists the same groups without creating them."""
    import datetime
    from functools import partial

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
    _dim = partial(_dimension, timeout=timeout)

    if p2p_groups not in ("channel", "shared"):
        raise ValueError(f"parallel.p2p_groups: {p2p_groups!r}; use 'channel' or 'shared'")
    pp_rank, dp_rank = layout.coords(rank)
    ep_rank = dp_rank % layout.ep
    meshes: list = []
    g = ParallelGroups(layout, rank, pp_rank, dp_rank, ep_rank, world_group=dist.group.WORLD, timeout_s=timeout_s)
    g.names[id(dist.group.WORLD)] = "world"
    P, D = layout.pp, layout.dp
    split = use_split()
    if p2p_groups == "shared":
        g.pp_group = _dim([[layout.rank(p, d) for p in range(P)] for d in range(D)], MeshAxis.PP,
                                device_type, meshes, split=split)
        if g.pp_group is not None:
            g.names.setdefault(id(g.pp_group), f"pp:{_members(g.pp_group)}")
    else:
        g.p2p_channels, names = build_p2p_channels(layout, rank, split, timeout)
        g.names.update(names)
    if layout.ep > 1:
        # the backward's exchanges have groups of their own over the same ranks (pipeline.distributed.expert):
        # every creation makes a new group, so the two sides never share one
        blocks = layout.expert_ranks().reshape(-1, layout.ep).tolist()
        g.ep_groups = {side: _dim(blocks, MeshAxis.EP, device_type, meshes, new=True, split=split,
                                        desc=f"ep-{side}") for side in ("F", "B")}
        for side, group in g.ep_groups.items():
            g.names[id(group)] = f"ep-{side}:{_members(group)}"
        if g.ep_groups["F"] is g.ep_groups["B"]:
            raise RuntimeError("the forward and backward expert-parallel exchanges got one process group; their "
                               "collectives could pair up across the two halves of an F&B pair")
    if layout.mirrored:
        g.dense_grad_group = _dim(layout.dense_grad_ranks().tolist(), MeshAxis.GRAD, device_type, meshes,
                                        split=split, desc="grad")
        g.dense_grad_size = 2 * D
    elif D > 1:
        g.dense_grad_group = _dim([[layout.rank(p, d) for d in range(D)] for p in range(P)], MeshAxis.DP,
                                        device_type, meshes, split=split, desc="grad")
        g.dense_grad_size = D
    copies = 2 * layout.edp if layout.mirrored else layout.edp
    if copies > 1:
        if layout.ep == 1:
            g.expert_grad_group = g.dense_grad_group  # every replica holds every expert
        else:
            sets = layout.expert_grad_ranks() if layout.mirrored else layout.expert_ranks().swapaxes(1, 2)
            g.expert_grad_group = _dim(sets.reshape(-1, copies).tolist(), MeshAxis.GRAD, device_type, meshes,
                                             split=split, desc="grad-experts")
        g.expert_grad_size = copies
    for role, group in (("grad", g.dense_grad_group), ("grad-experts", g.expert_grad_group)):
        if group is not None and id(group) not in g.names:
            g.names[id(group)] = f"{role}:{_members(group)}"
    g.meshes = tuple(meshes)
    return g
