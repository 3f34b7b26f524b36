"""Stage boundaries are priced where the runtime's mesh puts pipeline neighbours (global rank = pp_rank x D +
dp_rank): the cost model's placement (costmodel.physics.comm_cost.mesh_node) agrees with
pipeline.distributed.layout's ranks, and
a layout whose neighbours sit D ranks apart on different nodes pays the network, whatever its EP."""
from __future__ import annotations

import itertools

import pytest

from costmodel.physics.comm_cost import mesh_node, pp_link
from costmodel.physics.hardware import get_hardware
from pipeline.distributed.layout import Layout

HW = get_hardware("h800")  # 8 GPUs per node


@pytest.mark.parametrize("pp,dp", list(itertools.product([1, 2, 3, 4, 6, 8], [1, 2, 4, 8, 16])))
def test_the_cost_models_placement_is_the_runtimes(pp, dp):
    g = HW.gpus_per_node
    lay = Layout(pp=pp, dp=dp, ep=1, schedule="1f1b")
    for p, d in itertools.product(range(pp), range(dp)):
        assert mesh_node(p, d, dp, g) == lay.rank(p, d) // g
    crosses = any(lay.rank(p, d) // g != lay.rank(p + 1, d) // g for p in range(pp - 1) for d in range(dp))
    assert pp_link(HW, pp, dp, ep=1) is (HW.inter if crosses else HW.intra)


def test_neighbours_a_node_apart_pay_the_network_even_without_ep():
    # PP6 x DP8 on 8-GPU nodes: every pipeline neighbour is 8 ranks away, on the next node (the old rule priced
    # PP x EP <= 8 on NVLink)
    assert pp_link(HW, 6, 8, ep=1) is HW.inter
    assert pp_link(HW, 2, 4, ep=4) is HW.intra  # ranks 0-7: one node
    assert pp_link(HW, 4, 2, ep=2, ep_per_node=1) is HW.inter  # a spread EP placement is not the mesh's
