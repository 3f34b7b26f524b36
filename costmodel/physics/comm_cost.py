"""Communication, alpha-beta (costmodel.md §2.3-2.4): stage-boundary P2P and expert-parallel all-to-all.

    t_p2p      = alpha + S / (bw * eta)
    t_all2all  = (k-1) * alpha + (k-1)/k * S / (bw * eta)    (S = bytes one rank sends, itself included;
                                                             nccl-tests busbw factor (k-1)/k)
Placement (which fabric a transfer crosses) follows the layout: `gpus_per_node` GPUs share NVLink. An EP group
of k ranks with g of them per node (g = min(k, gpus_per_node) unless the layout spreads it: `ep_per_node`) sends
(k - g)/k of its bytes over the network and (g - 1)/k over NVLink, concurrently (the slower one sets the time).
A pipeline boundary sits where the runtime's mesh puts its two ranks (pipeline/distributed/layout.py: global rank
= pp_rank x D + dp_rank, so pipeline neighbours are D ranks apart): on NVLink when every pair of neighbours shares
a node, else on the network (the slowest boundary prices them all). An `ep_per_node` below what fits is a placement
other than the mesh's: its boundaries are priced on the network.

An EP group that spans nodes exchanges tokens the way DeepEP's internode kernels do (DeepSeek-V3 §3.2.2): a token
crosses the network once per other node its experts lie on and is forwarded inside that node over NVLink (the
combine reduces inside the node before it crosses back). Under balanced routing (experts chosen uniformly) a
token's top-k experts lie on `remote_nodes_per_token` other nodes, at most M - (M/N) with node-limited routing
(moe.max_nodes_per_token = M of the N nodes): the network carries remote_nodes / k of the bytes, NVLink the
(g - 1)/g of the copies not already on their GPU. One NIC per GPU carries both the all-to-all and the pipeline's
P2P when the stage boundaries cross nodes too: `nic_bytes`, the P2P bytes an action sends spread over its
all-to-alls, join their network part (the bytes are conserved; the P2P keeps its own latency).
"""
from __future__ import annotations

from costmodel.physics.hardware import HardwareSpec, Link


def boundary_bytes(tokens: int, width: int, hidden: int, dtype_bytes: int) -> float:
    """S_boundary = T * n * C * dtype bytes per micro-batch, stage boundary and direction."""
    return float(tokens * width * hidden * dtype_bytes)


def ep_ranks_per_node(hw: HardwareSpec, ep: int, ep_per_node: int | None = None) -> int:
    g = min(ep, hw.gpus_per_node)
    return g if ep_per_node is None else max(1, min(ep_per_node, g))


def mesh_node(pp_rank: int, dp_rank: int, dp: int, gpus_per_node: int) -> int:
    """The node of (pipeline rank, data-parallel rank) under the runtime's mesh (global rank = pp_rank x D + dp_rank,
    consecutive global ranks fill a node)."""
    return (pp_rank * dp + dp_rank) // gpus_per_node


def pp_link(hw: HardwareSpec, pp: int, dp: int, ep: int, ep_per_node: int | None = None) -> Link:
    """The fabric of the stage boundaries: NVLink only when every pair of pipeline neighbours shares a node."""
    if ep_per_node is not None and ep_per_node < min(ep, hw.gpus_per_node):
        return hw.inter  # a spread EP placement, not the mesh's
    g = hw.gpus_per_node
    crosses = any(mesh_node(p, d, dp, g) != mesh_node(p + 1, d, dp, g) for p in range(pp - 1) for d in range(dp))
    return hw.inter if crosses else hw.intra


def p2p_us(link: Link, nbytes: float) -> float:
    return link.time_us(nbytes)


def remote_nodes_per_token(experts: int, top_k: int, nodes: int, max_nodes: int | None = None) -> float:
    """Expected number of other nodes a token's top_k experts lie on, the experts spread evenly over `nodes` nodes
    and chosen uniformly (balanced routing), within `max_nodes` of them when routing is node-limited."""
    if nodes <= 1:
        return 0.0
    m = nodes if max_nodes is None else min(max_nodes, nodes)
    per_node = experts / nodes
    pool = m * per_node  # the experts on the token's m nodes
    miss = 1.0  # P(one of the m nodes holds none of the token's k experts): hypergeometric
    for i in range(min(top_k, int(pool))):
        miss *= max(0.0, pool - per_node - i) / (pool - i)
    return m * (1.0 - miss) * (nodes - 1) / nodes  # each chosen node is the token's own with probability 1/N


def all_to_all_us(hw: HardwareSpec, ep: int, nbytes: float, ep_per_node: int | None = None,
                  routing: tuple[int, int, int | None] | None = None, nic_bytes: float = 0.0) -> float:
    """Time of one all-to-all in which every rank of an EP group of `ep` sends `nbytes` in total. `routing` =
    (experts, top_k, max_nodes_per_token): an EP group over nodes sends each token once per remote node (module
    docstring); None = every copy crosses on its own. `nic_bytes`: P2P bytes sharing the NIC with it."""
    if ep <= 1 or nbytes <= 0:
        return 0.0
    g = ep_ranks_per_node(hw, ep, ep_per_node)
    if ep <= g:
        link = hw.intra
        return (ep - 1) * link.latency_us + (ep - 1) / ep * nbytes / (link.bandwidth * link.efficiency) * 1e6
    if routing is None:
        nvl_share, ib_share, ib_peers = (g - 1) / ep, (ep - g) / ep, ep - g
    else:
        experts, top_k, max_nodes = routing
        nodes = -(-ep // g)
        nvl_share = (g - 1) / g
        ib_share = remote_nodes_per_token(experts, top_k, nodes, max_nodes) / top_k
        ib_peers = nodes - 1
    intra = (g - 1) * hw.intra.latency_us + nvl_share * nbytes / (hw.intra.bandwidth * hw.intra.efficiency) * 1e6
    inter = ib_peers * hw.inter.latency_us + (ib_share * nbytes + nic_bytes) / (
        hw.inter.bandwidth * hw.inter.efficiency) * 1e6
    return max(intra, inter)
