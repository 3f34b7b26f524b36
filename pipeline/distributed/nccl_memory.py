"""NCCL's connection buffers per rank, as a range with its assumptions stated (`mhcpipe layout`).

What NCCL allocates per connection (one peer, one direction) and channel, for each protocol it may use (defaults
of NCCL's src/init.cc, overridable with NCCL_BUFFSIZE / NCCL_LL_BUFFSIZE / NCCL_LL128_BUFFSIZE):
Simple NCCL_BUFFSIZE = 4 MiB, LL = 8 lines x 512 threads x 8 steps x 16 B = 512 KiB, LL128 = 120 x 640 x 8 x 8 B =
4.69 MiB (LL128 only where the link supports it: NVLink). How many channels a connection gets depends on the link
and on NCCL's tuning, which this cannot see; so the estimate is a range:
* low: Simple only, 2 channels per connection (NCCL's P2P default per peer over the network);
* high: all three protocols (LL128 on NVLink only), and for collectives (ring neighbours, all-to-all peers) the
  channel counts NCCL reaches on the link: 32 on NVLink (H100-class NVSwitch systems), 4 over the network
  (2 NICs' worth of NCCL_NCHANNELS_PER_NET_PEER); P2P channels (send/recv between two ranks) 8 on NVLink, 2 over the
  network.
A group whose members all sit on one node (global rank // GPUs per node) talks over NVLink, else over the network.
Peers per group: 1 on a two-rank group, 2 ring neighbours on an all-reduce group, every other member on an
all-to-all (expert) group. NVLS/CollNet buffers (NVLink SHARP) and NCCL's own device memory outside the buffers are
not counted.
"""
from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20
SIMPLE = 4 * MIB
LL = 8 * 512 * 8 * 16
LL128 = 120 * 640 * 8 * 8


@dataclass(frozen=True)
class LinkChannels:
    p2p: int
    collective: int


LOW = {"nvlink": LinkChannels(2, 2), "network": LinkChannels(2, 2)}
HIGH = {"nvlink": LinkChannels(8, 32), "network": LinkChannels(2, 4)}
ASSUMPTIONS = ("low: Simple protocol only, 2 channels per connection; high: Simple + LL + LL128 (NVLink), "
               "32 channels per collective connection on NVLink and 4 over the network, 8 / 2 per P2P "
               "connection; NVLS and NCCL's other device memory not counted")


def peers(role: str, size: int) -> int:
    """Connections a member of a group of `size` ranks makes for the group's op."""
    if size == 2:
        return 1
    return size - 1 if role.startswith("ep") else 2


def link(members, gpus_per_node: int) -> str:
    return "nvlink" if len({m // gpus_per_node for m in members}) == 1 else "network"


def group_bytes(role: str, members, gpus_per_node: int, high: bool) -> int:
    """Buffer bytes one member holds for one group (both directions of each connection)."""
    kind = link(members, gpus_per_node)
    ch = (HIGH if high else LOW)[kind]
    channels = ch.p2p if len(members) == 2 else ch.collective
    per_channel = SIMPLE + ((LL + (LL128 if kind == "nvlink" else 0)) if high else 0)
    return peers(role, len(members)) * channels * 2 * per_channel


def rank_range_mib(groups, gpus_per_node: int) -> tuple[float, float]:
    """(low, high) MiB of NCCL buffers one rank holds for `groups` (objects with role and members)."""
    lo = sum(group_bytes(g.role, g.members, gpus_per_node, False) for g in groups)
    hi = sum(group_bytes(g.role, g.members, gpus_per_node, True) for g in groups)
    return lo / MIB, hi / MIB
