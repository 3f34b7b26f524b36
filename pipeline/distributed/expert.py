"""Expert parallelism: MoE token dispatch and combine over an EP group with all-to-all, asynchronous.

Shape letters: T tokens of a micro-batch, k experts per token, E routed experts, EP ranks in the group,
E_l = E / EP experts per rank, C hidden, N = T*k routed rows of one rank.

`pipeline.model.MoE` sorts its N (token, expert) slots by expert (one stable argsort), so the rows for one EP rank
form one block, and calls `ExpertComm.routed`:
1. the per-expert counts [E] go out with one `all_to_all_single` (each rank learns how many rows every source
   sends to each of its local experts);
2. one host read of both count vectors gives the split sizes: the only host synchronisation of the layer, none
   per expert;
3. `A2A_DISPATCH`: the rows go out with `all_to_all_single(out_splits, in_splits)`; the receiver regroups them
   expert-major (a stable argsort of each row's local expert), runs each local expert on a contiguous slice and
   restores the source-major order;
4. `A2A_COMBINE`: the outputs go back with the reverse splits, one row per slot in the sender's order.
Backward mirrors it (the autograd Function `_Exchange` below): the gradient of the combine is a dispatch-direction
all-to-all
(`A2A_COMBINE/.../L13.dgrad`) and that of the dispatch a combine-direction one (`A2A_DISPATCH/.../L13.dgrad`).

Every exchange is posted asynchronously and waited right before its result is used. Between the two, when an
F&B pair is running (`pipeline.runtime.overlap.PairRunner`), the other half of the pair computes: that is DualPipe's
overlap of one micro-batch's all-to-all with the other's compute. Forward and backward exchanges go to two
process groups over the same EP ranks: within each, every rank issues its exchanges in program order (the same
schedule), as collectives require, while the two halves of a pair may interleave differently on each rank.
Spans: `~comm` from post to completion, `WAIT` when the compute thread blocks (comm.Comms).
"""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from pipeline.distributed.comm import Comms
from pipeline.distributed.errors import PipelineError
from traces.trace import span_name


class ExpertComm:
    """The EP group of one rank, with the waits, spans and F&B hand-over of its exchanges."""

    def __init__(self, groups: dict[str, object], size: int, rank: int, comms: Comms, pair=None,
                 names: dict[str, str] | None = None):
        self.groups = groups  # "F": forward exchanges, "B": backward ones (two process groups of the same ranks)
        self.names = names or {side: f"ep-{side}" for side in groups}  # each group's name (trace spans)
        # the MoE layers exchange over the group (a 1-rank group runs its experts locally, unless a one-GPU check
        # sets this to run the all-to-alls, and so the threaded F&B pair, anyway: bench/gpu_pair_check.py)
        self.exchanging = size > 1
        self.size = size  # EP ranks
        self.rank = rank  # this rank's index in the EP group
        self.comms = comms
        self.pair = pair  # pipeline.runtime.overlap.PairRunner, or None (serial)
        self._tls = threading.local()
        members = dist.get_process_group_ranks(groups["F"])
        self.peers = f"EP group (ranks {', '.join(map(str, members))})"

    # -- which (stage, micro-batch) the calling thread's forward belongs to: names the spans ------------------
    def set_chunk(self, stage: int, mb: int) -> None:
        self._tls.chunk = (stage, mb)

    def chunk(self) -> tuple[int | None, int | None]:
        return getattr(self._tls, "chunk", (None, None))

    # -- one exchange ---------------------------------------------------------------------------------------
    def exchange(self, send: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None, *, op: str,
                 chunk: tuple, layer: int, part: str | None, side: str, resume: str) -> torch.Tensor:
        """all_to_all_single of `send` (rows split by in_splits) into a fresh buffer (out_splits rows per source;
        None = equal splits); while it flies the other half of a running F&B pair computes."""
        rows = send.shape[0] if out_splits is None else sum(out_splits)
        out = send.new_empty((rows,) + tuple(send.shape[1:]))
        stage, mb = chunk
        name = span_name(op, stage, mb, part=f"L{layer}" + (f".{part}" if part else ""))
        h = self.comms.post(dist.all_to_all_single, out, send.contiguous(), out_splits, in_splits,
                            group=self.groups[side], group_name=self.names[side], name=name,
                            kind=op if part is None else f"{op}.{part}",
                            stage=stage, mb=mb, peer=self.peers)
        pair = self.pair
        if pair is None:
            self.comms.wait(h)
            return out
        pair.switch(side)
        pair.wait(side, h)
        pair.resume(side, f"L{layer}.{resume}")
        return out

    def counts(self, counts: torch.Tensor, chunk: tuple, layer: int) -> tuple[torch.Tensor, list[int]]:
        """Exchange the per-expert counts [EP*E_l]; returns what arrived and, read on the host, both vectors (the
        split sizes): the layer's one host synchronisation. On CUDA the host copy is queued on a side stream
        behind the exchange alone, so the host waits for the counts, not for whatever the other half of an F&B
        pair queued on the compute stream meanwhile."""
        stage, mb = chunk
        recv = torch.empty_like(counts)
        name = span_name("A2A_DISPATCH", stage, mb, part=f"L{layer}.counts")
        h = self.comms.post(dist.all_to_all_single, recv, counts, None, None, group=self.groups["F"],
                            group_name=self.names["F"], name=name, kind="A2A_DISPATCH.counts", stage=stage, mb=mb,
                            peer=self.peers)
        read = self.comms.host_read(h, [counts, recv])
        if self.pair is None:
            self.comms.wait(h)
        else:
            self.pair.switch("F")
            self.pair.wait("F", h)
            self.pair.resume("F", f"L{layer}.dispatch")
        return recv, read()

    def routed(self, moe, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert outputs for `rows` [N, C] (sorted by expert, counts[e] rows for expert e) over the EP group;
        one output row per input row, same order."""
        ep, e_l, layer = self.size, moe.num_local, moe.layer
        chunk = self.chunk()
        recv_counts, both = self.counts(counts, chunk, layer)  # [EP*E_l]: [source, expert]; the one host read
        sent, got = both[:ep * e_l], both[ep * e_l:]
        in_splits = [sum(sent[r * e_l:(r + 1) * e_l]) for r in range(ep)]
        out_splits = [sum(got[r * e_l:(r + 1) * e_l]) for r in range(ep)]
        per_expert = [sum(got[r * e_l + j] for r in range(ep)) for j in range(e_l)]
        meta = (self, chunk, layer)
        recv = _Exchange.apply(rows, meta, "A2A_DISPATCH", out_splits, in_splits)  # [R, C] source-major
        local = torch.arange(e_l, device=rows.device).repeat(ep)  # local expert of each (source, expert) block
        expert_of_row = torch.repeat_interleave(local, recv_counts, output_size=sum(out_splits))  # no device sync
        perm = torch.argsort(expert_of_row, stable=True)  # expert-major, sources in order within an expert
        y = moe.local_experts(recv.index_select(0, perm), per_expert)
        y_src = y.index_select(0, torch.argsort(perm))  # back to source-major
        return _Exchange.apply(y_src, meta, "A2A_COMBINE", in_splits, out_splits)


class _Exchange(torch.autograd.Function):
    """One all-to-all as an autograd node: A2A_DISPATCH (rows to the ranks that hold their experts; after it the
    experts run) or A2A_COMBINE (outputs back to the ranks that own the tokens). Its backward is the same op's
    reverse exchange of the gradients (`.dgrad`), after which the backward of what preceded it runs."""

    RESUME = {"A2A_DISPATCH": ("experts", "router"), "A2A_COMBINE": ("combine", "experts")}  # (forward, backward)

    @staticmethod
    def forward(ctx, rows, meta, op, out_splits, in_splits):
        comm, chunk, layer = meta
        ctx.meta, ctx.op, ctx.splits = meta, op, (out_splits, in_splits)
        return comm.exchange(rows, out_splits, in_splits, op=op, chunk=chunk, layer=layer, part=None, side="F",
                             resume=_Exchange.RESUME[op][0])

    @staticmethod
    def backward(ctx, grad):
        comm, chunk, layer = ctx.meta
        out_splits, in_splits = ctx.splits
        g = comm.exchange(grad, in_splits, out_splits, op=ctx.op, chunk=chunk, layer=layer, part="dgrad", side="B",
                          resume=_Exchange.RESUME[ctx.op][1])
        return g, None, None, None, None


def start_count_read(counts: torch.Tensor, timeout_s: float, dev=None):
    """Start reading the per-expert row counts to the host (the per-expert slices need their sizes there: the
    layer's one host wait, EP=1; with EP the count exchange's read, `ExpertComm.counts`, is that one);
    returns the reader. CUDA (`dev`, pipeline.device): a non-blocking copy into pinned memory and an event, queued
    now on the compute stream, and the reader polls the event with a deadline, so the host waits for the kernels up
    to the counts and not for the ones queued after them; elsewhere the reader reads the tensor."""
    if dev is None:
        return counts.tolist
    done, host = dev.read_later([counts], dev.current_stream())

    def read() -> list[int]:
        if not dev.host_wait_events([done], timeout_s):
            raise PipelineError(f"timed out after {timeout_s:g} s reading the MoE expert counts (the GPU did not "
                                "reach them: a hung kernel, or an input a peer never sent)")
        return host().tolist()

    return read
