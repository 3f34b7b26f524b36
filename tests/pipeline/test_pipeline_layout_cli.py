"""`mhcpipe layout` (mhcpipe/layout_cli.py): the groups of a layout before a launch, at DeepSeek-V4-Pro scale
(PP16 x DP128, EP64: 2,048 ranks). That the plan is what a start-up makes is
test_pipeline_layout.py::test_the_group_plan_is_what_the_start_up_makes."""
from __future__ import annotations

import json

import pytest

from _pipeline_helpers import mhcpipe_in_process
from pipeline.distributed.group_plan import groups_of, plan_groups
from pipeline.distributed.layout import Layout


def test_v4_pro_at_2048_ranks(tmp_path):
    out = mhcpipe_in_process("layout", "--config", "v4-pro", "--dp", "128", "--rank", "130",
                             "--json", str(tmp_path / "l.json"))
    assert out.returncode == 0, out.stderr
    got = json.loads((tmp_path / "l.json").read_text())
    lay = Layout(16, 128, 64, "dualpipe")
    plan = plan_groups(lay)
    # counted here from the layout's own rules: 2 directions x 15 links x 128 rows; EP groups of 64 per pipeline
    # rank and expert replica (16 x 2), twice (forward and backward exchanges)
    assert got["by_role"]["p2p"] == 2 * 15 * 128 and got["by_role"]["ep-F"] == got["by_role"]["ep-B"] == 16 * 2
    assert got["num_groups"] == len(plan) and got["creations"] == len(plan) - 1 and got["world"] == 2048
    assert got["num_groups"] == len(got["groups"])
    # per rank: its world, 2 or 4 channels, EP forward and backward, dense and expert gradient groups
    assert got["communicators_per_rank"] == [7, 9]
    mine = groups_of(plan, 130)
    assert got["warmup_order"] == sorted(g.name for g in mine)
    assert "p2p:2>130" in got["warmup_order"] and "p2p:130>258" in got["warmup_order"]  # its pipeline neighbours
    lines = out.stdout.splitlines()
    assert lines[0].startswith("layout v4-pro: dualpipe PP16 x DP128 (EP64") and "2048 ranks" in lines[0]
    # NCCL: 4 channel families (per direction, links from even and odd pipeline ranks), ep-F, ep-B, grad, grad-experts
    assert got["nccl_splits"] == 8
    assert f"start-up: {len(plan) - 1} groups" in lines[1] and "8 on NCCL" in lines[1] and "4424 on gloo" in lines[1]


@pytest.mark.parametrize("args,field", [
    (["--config", "v4-pro", "--dp", "96"],
     "parallel.expert_parallel=64 (--ep) must divide parallel.data_parallel=96 (--dp)"),
    (["--config", "tiny", "--rank", "4"], "--rank 4: the layout has ranks 0..3"),
    (["--config", "tiny", "--dp", "0"], "--dp 0"),
    (["--config", "no-such-preset"], "unknown preset"),
])
def test_bad_input_is_one_line(args, field):
    out = mhcpipe_in_process("layout", *args)
    err = out.stderr.strip()
    assert out.returncode == 2 and len(err.splitlines()) == 1 and field in err, err


def test_nccl_buffers_are_a_range_from_protocols_channels_and_links():
    """NCCL's defaults (src/init.cc): Simple 4 MiB, LL 8x512x8x16 B, LL128 120x640x8x8 B per channel, peer and
    direction; the low end is Simple at 2 channels, the high end every protocol the link supports at the channels
    NCCL reaches on it; a two-rank group is one peer, an all-reduce ring two, an all-to-all every other member."""
    from pipeline.distributed import nccl_memory as nm

    assert (nm.SIMPLE, nm.LL, nm.LL128) == (4 << 20, 524288, 4915200)
    mib = 1 << 20
    # a P2P channel inside a node (NVLink) and across nodes (network)
    assert nm.group_bytes("p2p", (0, 1), 8, high=False) == 1 * 2 * 2 * 4 * mib
    assert nm.group_bytes("p2p", (0, 1), 8, high=True) == 1 * 8 * 2 * (nm.SIMPLE + nm.LL + nm.LL128)
    assert nm.group_bytes("p2p", (0, 8), 8, high=True) == 1 * 2 * 2 * (nm.SIMPLE + nm.LL)  # no LL128 off NVLink
    # an 8-rank all-to-all group: 7 peers; an all-reduce group: 2 ring neighbours
    assert nm.group_bytes("ep-F", tuple(range(8)), 8, high=False) == 7 * 2 * 2 * 4 * mib
    assert nm.group_bytes("grad", tuple(range(8)), 8, high=False) == 2 * 2 * 2 * 4 * mib
    lo, hi = nm.rank_range_mib([type("G", (), {"role": "p2p", "members": (0, 1)})()], 8)
    assert lo < hi


def test_layout_prints_the_nccl_buffer_range_with_its_assumptions():
    r = mhcpipe_in_process("layout", "--config", "tiny-moe", "--pp", "2", "--dp", "2", "--ep", "2",
                           "--gpus-per-node", "2")
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("per rank:"))
    assert "NCCL buffers" in line and "2 GPUs per node" in line and "low: Simple protocol only" in line
    bad = mhcpipe_in_process("layout", "--config", "tiny", "--gpus-per-node", "0")
    assert bad.returncode == 2 and "--gpus-per-node 0: must be >= 1" in bad.stderr
