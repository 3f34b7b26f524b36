"""The parallel layout: rank coordinates, the rank tensors of its meshes, and the process groups built from them
(4 gloo ranks): pipeline, EP (a separate group for the backward's all-to-alls), gradient groups that fold
DualPipe's mirrored copies into data parallelism."""
from __future__ import annotations

import pytest
import torch

from _pipeline_helpers import check_ok, tiny_config
from configs import parse_config
from pipeline.distributed.layout import Layout
from rank_pool import launch


def test_rank_coordinates_and_mesh_tensors():
    lay = Layout(pp=2, dp=4, ep=2, schedule="dualpipe")
    assert lay.world == 8 and lay.edp == 2
    assert [lay.coords(r) for r in (0, 3, 4, 7)] == [(0, 0), (0, 3), (1, 0), (1, 3)]
    assert lay.rank(1, 2) == 6
    # EP groups are consecutive ranks inside one pipeline rank's replicas
    assert lay.expert_ranks().reshape(-1, 2).tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # DualPipe: pipeline ranks 0 and 1 hold the same chunks; dense grads over both x all replicas
    assert lay.dense_grad_ranks().tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    # an expert's copies: same EP rank, every replica block, both mirrored pipeline ranks
    assert lay.expert_grad_ranks().tolist() == [[[0, 2, 4, 6], [1, 3, 5, 7]]]
    plain = Layout(pp=4, dp=2, ep=1, schedule="1f1b")
    assert plain.dense_grad_ranks().tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize("moe,change,field", [
    (True, dict(expert_parallel=4), "must divide parallel.data_parallel"),
    (False, dict(expert_parallel=2), "has no MoE"),
])
def test_layout_check_names_the_field(moe, change, field):
    cfg = tiny_config("1f1b", 2, dp=2, moe=moe)
    cfg["parallel"].update(change)
    with pytest.raises(ValueError, match=field):
        Layout.of(parse_config(cfg)).check(parse_config(cfg))


def test_world_must_be_pp_times_dp():
    cfg = parse_config(tiny_config("1f1b", 2, dp=2))
    with pytest.raises(ValueError, match=r"--pp 2\) x parallel.data_parallel \(--dp 2\) = 4, but 3 processes"):
        Layout.of(cfg).check(cfg, 3)


def _groups_worker(rank, world, cfg_dict):
    import torch.distributed as dist

    from pipeline.runtime.train import make_groups

    g = make_groups(parse_config(cfg_dict), rank, world, torch.device("cpu"))
    ranks = lambda grp: None if grp is None else dist.get_process_group_ranks(grp)  # noqa: E731
    return {"pp": ranks(g.pp_group), "channels": sorted(g.name_of(c) for c in g.p2p_channels.values()),
            "ep_f": ranks(g.ep_groups["F"]), "ep_b": ranks(g.ep_groups["B"]),
            "same_ep_group": g.ep_groups["F"] is g.ep_groups["B"], "dense": ranks(g.dense_grad_group),
            "expert": ranks(g.expert_grad_group), "coords": (g.pp_rank, g.dp_rank, g.ep_rank)}


@pytest.mark.timeout(120)
def test_groups_from_the_mesh():
    cfg = tiny_config("dualpipe", 2, moe=True, dp=2, ep=2)
    results = launch(_groups_worker, 4, (cfg,), timeout_s=100)
    check_ok(results)
    for r in results:
        v = r.value
        pp_rank, dp_rank = divmod(r.rank, 2)
        assert v["coords"] == (pp_rank, dp_rank, dp_rank)
        assert v["pp"] is None  # no group for the pipeline row: its links are the channels (only 'shared' has one)
        assert v["channels"] == sorted([f"p2p:{dp_rank}>{2 + dp_rank}", f"p2p:{2 + dp_rank}>{dp_rank}"])
        assert v["ep_f"] == v["ep_b"] == [2 * pp_rank, 2 * pp_rank + 1]
        assert not v["same_ep_group"], "forward and backward all-to-alls share a process group"
        assert v["dense"] == [0, 1, 2, 3]  # DualPipe's mirrored pipeline ranks x both replicas
        assert v["expert"] == [dp_rank, 2 + dp_rank]  # this EP rank's copies on both mirrored pipeline ranks


PLANNED = [Layout(4, 1, 1, "1f1b"), Layout(2, 2, 2, "dualpipe"), Layout(2, 2, 2, "dualpipev"),
           Layout(2, 2, 1, "zb1p"), Layout(1, 4, 2, "dualpipev"), Layout(2, 2, 1, "dualpipe"), Layout(1, 4, 4, "1f1b")]


def _real_groups_worker(rank, world, layouts):
    """For each layout: the named groups build_groups gives this rank, and the rank sets of every group it joined
    (torch's group registry: test-only, to check the plan's count)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from pipeline.distributed.layout import build_groups

    out = []
    for lay in layouts:
        before = set(c10d._world.pg_map)
        g = build_groups(lay, rank, "cpu")
        joined = sorted(sorted(dist.get_process_group_ranks(pg)) for pg in set(c10d._world.pg_map) - before)
        names = g.comm_groups()
        if g.pp_group not in (None, g.world_group) and g.p2p_channels is not None:  # named, never posted on
            names.pop(g.name_of(g.pp_group), None)
        out.append((names, [m for m in joined if len(m) > 1]))
        dist.barrier()
    return out


@pytest.mark.timeout(120)
def test_the_group_plan_is_what_the_start_up_makes():
    """`mhcpipe layout` reads pipeline.distributed.group_plan: on 4 gloo ranks, for seven layouts, every group a rank
    uses has the plan's name and members, and the groups the rank joined at start-up (groups of one rank aside)
    are the plan's groups that hold it: the start-up makes no group the runtime does not post on."""
    from pipeline.distributed.group_plan import groups_of, plan_groups

    results = launch(_real_groups_worker, 4, (PLANNED,), timeout_s=100)
    check_ok(results)
    for i, lay in enumerate(PLANNED):
        plan = plan_groups(lay)
        for r in results:
            names, joined = r.value[i]
            want = {g.name: sorted(g.members) for g in groups_of(plan, r.rank)}
            assert names == want, (lay, r.rank, names, want)
            planned = sorted(sorted(g.members) for g in groups_of(plan, r.rank) if g.name != "world")
            assert joined == planned, (lay, r.rank, joined, planned)


def _split_groups_worker(rank, world, layouts):
    """build_groups on the NCCL path (split_group), with a stand-in for split_group that gloo can run: one
    new_group per set of the family. Counts the split calls and any new_group made outside them."""
    import torch.distributed as dist

    from pipeline.distributed import layout as layout_mod

    real_new_group = dist.new_group
    splits, direct = [], []

    def fake_split(parent_pg=None, split_ranks=None, timeout=None, pg_options=None, group_desc=None, backend=None):
        assert parent_pg is None and split_ranks, "a split of the world with its sets"
        flat = [r for s in split_ranks for r in s]
        assert len(flat) == len(set(flat)), f"{group_desc}: the sets of one split must be disjoint: {split_ranks}"
        splits.append(group_desc)
        mine = None
        for members in split_ranks:
            g = real_new_group(members)
            if rank in members:
                mine = g
        return mine

    def counted_new_group(*args, **kwargs):
        direct.append(args)
        return real_new_group(*args, **kwargs)

    out = []
    dist.split_group, dist.new_group = fake_split, counted_new_group
    use_split, layout_mod.use_split = layout_mod.use_split, lambda env=None: True
    try:
        for lay in layouts:
            splits.clear()
            direct.clear()
            g = layout_mod.build_groups(lay, rank, "cpu")
            out.append((g.comm_groups(), list(splits), len(direct)))
            dist.barrier()
    finally:
        dist.new_group, layout_mod.use_split = real_new_group, use_split
        del dist.split_group
    return out


@pytest.mark.timeout(120)
def test_on_nccl_one_split_makes_each_family_of_groups():
    """NCCL path: every family of disjoint groups (4 channel families, ep-F, ep-B, grad, grad-experts) is one
    split_group of the world instead of one world-wide new_group per group, and each rank gets the same groups by
    name and members as the plan (`mhcpipe layout` counts these splits)."""
    from pipeline.distributed.group_plan import groups_of, plan_groups, world_wide_creations

    results = launch(_split_groups_worker, 4, (PLANNED,), timeout_s=100)
    check_ok(results)
    for i, lay in enumerate(PLANNED):
        plan = plan_groups(lay)
        for r in results:
            names, splits, direct = r.value[i]
            assert names == {g.name: sorted(g.members) for g in groups_of(plan, r.rank)}, (lay, r.rank)
            assert direct == 0, (lay, "a group made with new_group on the split path")
            assert len(splits) == world_wide_creations(plan, split=True), (lay, splits)
    assert world_wide_creations(plan_groups(Layout(16, 128, 64, "dualpipe")), split=True) == 8
