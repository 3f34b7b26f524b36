"""Overlap inside one schedule action: per-rank streams (compute, high-priority compute, comm) and interference.

The schedule simulator (schedules.simulate) treats an action as one compute span. Its duration is decided here by
a small discrete-event simulation of the action's kernels (costmodel.md §2.5-2.6):

* Chains: an action is one chain of kernels (F, I, W, B) or two (an overlapped F&B step: the forward of one
  chunk and the full backward of another, as DualPipe pairs them). Within a chain each kernel waits for its
  `deps` (by default the previous kernel); the two chains of an F&B step are independent, which is what lets
  one chunk's all-to-all hide under the other's compute.
* Streams: "compute" and "hp" kernels share the SMs (one runs at a time); "comm" kernels (expert all-to-all)
  run on their own stream, one at a time, in ready order. A free compute stream picks the ready kernel with the
  longest remaining path to the end of its chain (HLFET list scheduling), so the two chains interleave the
  way DualPipe's hand-written order does: work that leads to an all-to-all first, W-like leaves in the gaps.
* High-priority stream: a ready "hp" kernel (mHC post+res of an MLP sub-layer, and its backward) preempts the
  running normal kernel if that kernel is preemptible (it resumes afterwards); large cuBLAS GEMMs are not
  (gpu.md §6: they did not yield SMs mid-kernel), so there the hp kernel waits only for the running GEMM, not for
  the queue. With `hp=False` hp kernels are ordinary compute kernels.
* Interference: while an all-to-all runs, compute progresses at rate 1 / (1 + sigma) (costmodel.md §2.5:
  t' = t (1 + sigma * overlapped fraction)). sigma = 0 is the optimistic bound.
* Modes: "streams" (the above), "serial" (every kernel back to back, all-to-all exposed: F&B = F + B as the
  DeepSeek figures draw it), "max" (F&B = max(F, B), each half computed in "streams" mode).

Exposed communication is an output (comm time with no compute running), never an input formula.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

MODES = ("streams", "serial", "max")


@dataclass(frozen=True)
class TimedOp:
    name: str
    group: str
    stream: str  # compute | hp | comm
    duration: float
    deps: tuple[int, ...] = (-1,)
    preemptible: bool = True


@dataclass
class OverlapResult:
    makespan: float
    compute_busy: float
    comm_busy: float
    exposed_comm: float
    group_time: dict[str, float] = field(default_factory=dict)  # summed kernel durations per group


def _group_time(chains: list[list[TimedOp]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for chain in chains:
        for op in chain:
            out[op.group] = out.get(op.group, 0.0) + op.duration
    return out


def run_streams(chains: list[list[TimedOp]], sigma: float = 0.0, hp: bool = True) -> OverlapResult:
    ops: list[TimedOp] = []
    chain_of: list[int] = []
    base: list[int] = []
    for c, chain in enumerate(chains):
        base.append(len(ops))
        ops.extend(chain)
        chain_of.extend([c] * len(chain))
    N = len(ops)
    succ: list[list[int]] = [[] for _ in range(N)]
    missing = [0] * N
    for c, chain in enumerate(chains):
        for i, op in enumerate(chain):
            for off in op.deps:
                j = i + off
                if 0 <= j < len(chain) and off < 0:
                    succ[base[c] + j].append(base[c] + i)
                    missing[base[c] + i] += 1
    # priority: the longest remaining path through the kernel's successors ("bottom level", HLFET list
    # scheduling), so kernels that lead to an all-to-all or to the end of a chain go first and W-like leaves
    # fill the gaps; ties by chain, then program order
    level = [0.0] * N
    for i in range(N - 1, -1, -1):
        level[i] = ops[i].duration + max((level[j] for j in succ[i]), default=0.0)
    queues: dict[str, list] = {"compute": [], "hp": [], "comm": []}

    def stream_of(i: int) -> str:
        s = ops[i].stream
        return "compute" if (s == "hp" and not hp) else s

    def push(i: int, t: float) -> None:
        st = stream_of(i)
        heapq.heappush(queues[st], (t, chain_of[i], i) if st == "comm" else (-level[i], chain_of[i], i))

    for i in range(N):
        if missing[i] == 0:
            push(i, 0.0)
    t = 0.0
    cur: list | None = None  # [op index, remaining work]
    suspended: list[list] = []
    comm: tuple[int, float] | None = None  # (op index, end time)
    done = 0
    busy_c = busy_m = exposed = 0.0
    while done < N:
        if comm is None and queues["comm"]:
            _, _, i = heapq.heappop(queues["comm"])
            comm = (i, t + ops[i].duration)
        if queues["hp"] and (cur is None or (stream_of(cur[0]) == "compute" and ops[cur[0]].preemptible)):
            if cur is not None:
                suspended.append(cur)
            _, _, i = heapq.heappop(queues["hp"])
            cur = [i, ops[i].duration]
        if cur is None:
            if suspended:
                cur = suspended.pop()
            elif queues["compute"]:
                _, _, i = heapq.heappop(queues["compute"])
                cur = [i, ops[i].duration]
        if cur is None and comm is None:
            raise RuntimeError("overlap: kernels wait on each other (bad deps); this is a cost-model bug")
        rate = 1.0 / (1.0 + sigma) if (comm is not None and cur is not None) else 1.0
        t_c = t + cur[1] / rate if cur is not None else float("inf")
        t_m = comm[1] if comm is not None else float("inf")
        t_next = min(t_c, t_m)
        dt = t_next - t
        if cur is not None:
            busy_c += dt
            cur[1] -= dt * rate
        if comm is not None:
            busy_m += dt
            if cur is None:
                exposed += dt
        t = t_next
        finished = []
        if cur is not None and (t_c <= t_m or cur[1] <= 1e-12):
            finished.append(cur[0])
            cur = None
        if comm is not None and t_m <= t_c:
            finished.append(comm[0])
            comm = None
        for i in finished:
            done += 1
            for j in succ[i]:
                missing[j] -= 1
                if missing[j] == 0:
                    push(j, t)
    return OverlapResult(t, busy_c, busy_m, exposed, _group_time(chains))


def run_serial(chains: list[list[TimedOp]]) -> OverlapResult:
    comm = sum(op.duration for chain in chains for op in chain if op.stream == "comm")
    total = sum(op.duration for chain in chains for op in chain)
    return OverlapResult(total, total - comm, comm, comm, _group_time(chains))


def overlap(chains: list[list[TimedOp]], mode: str = "streams", sigma: float = 0.0, hp: bool = True) -> OverlapResult:
    """Duration of one action made of `chains` (1 chain, or 2 for an F&B step)."""
    if mode not in MODES:
        raise ValueError(f"unknown overlap mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "serial":
        return run_serial(chains)
    if mode == "max" and len(chains) > 1:
        parts = [run_streams([c], sigma, hp) for c in chains]
        best = max(parts, key=lambda r: r.makespan)
        return OverlapResult(best.makespan, sum(p.compute_busy for p in parts), sum(p.comm_busy for p in parts),
                             best.exposed_comm, _group_time(chains))
    return run_streams(chains, sigma, hp)
