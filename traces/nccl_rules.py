"""NCCL's ordering rules, in one home: what the strict transport enforces live on gloo
(pipeline.distributed.strict_transport), what `mhcpipe check-comm` replays on a trace
(traces.analysis.comm_replay) and on the emulated CUDA device's programs (traces.analysis.cuda_replay). Sources:
docs/communication.md and docs/cuda_program.md §Rules.

* FIFO: a communicator runs its launches (a batch of P2P ops, or one collective) one at a time, in posting order.
  The views say what one communicator is: `group` (every op of a process group on one queue) or `pair` (P2P ops
  one queue per (group, peer), as ProcessGroupNCCL's lazily made two-rank P2P communicators give).
* RENDEZVOUS: a send completes only while its peer's matching receive runs; on one communicator the k-th send
  from a to b meets the k-th receive at b from a, whatever they carry (NCCL matches by position, not by tag).
* COLLECTIVE: a collective completes once every member runs it; the k-th collectives of all members run together.
* CONNECT: the first op between two ranks on a communicator connects them and blocks the posting host until the
  peer posts there; the first collective connects all members.
"""
from __future__ import annotations

VIEWS = ("group", "pair")
# train.comm_rules (also --comm-rules, $MHCPIPE_COMM_RULES) -> the view its strict transport runs
VIEW_OF_RULES = {"nccl": "group", "nccl-pair": "pair"}

FIFO = "one communicator runs its launches one at a time, in posting order"
RENDEZVOUS = "a send or receive completes only while its peer's matching op runs"
COLLECTIVE = "a collective completes once every member runs it"
CONNECT = "the first op on a communicator connects: the host waits for the peer to post there"


def message_key(name: str) -> str:
    """What both ends of a P2P message name: F/s0/mb3 for SEND_F/s0/mb3 and RECV_F/s0/mb3 (a name without a
    SEND_/RECV_ kind is its own key)."""
    head, _, rest = name.partition("/")
    kind = head.split("_", 1)[1] if "_" in head else head
    return f"{kind}/{rest}" if rest else kind


def queue_of(view: str, group: str, peer: int | None) -> str:
    """The communicator (queue) an op runs on in `view`: its group, or (pair view, a P2P op) its group and peer."""
    if view not in VIEWS:
        raise ValueError(f"view {view!r}: use one of {', '.join(VIEWS)}")
    return group if view == "group" or peer is None else f"{group}|{peer}"


def p2p_slot(src: int, dst: int, k: int) -> tuple[int, int, int]:
    """The k-th message from src to dst on one communicator: the send and the receive that share it meet."""
    return (src, dst, k)


def connection(comm: str, a: int, b: int | None = None) -> tuple:
    """The connection an op needs: two ranks on a communicator (P2P, each pair of an all-to-all), or the
    communicator's collective connection (b None)."""
    return (comm, "coll") if b is None else (comm, *sorted((a, b)))
