"""Inside one schedule action: its kernels on a rank's three streams (compute, high-priority compute, comm), in
program order, sharing the GPU's SMs and HBM bandwidth (costmodel.md §2.5-2.6).

The schedule simulator (schedules.engine) treats an action as one compute span; how long it lasts, and when
inside it the outputs are ready to send, is decided here.

* Chains: an action is one chain of kernels (F, I, W, B) or two (an overlapped F&B pair: the forward of one chunk
  and the backward of another, as DualPipe pairs them). Within a chain a kernel waits for its `deps` (by default
  the previous kernel). Chain c may not start before `lags[c]` (its receive arrives later than the action starts:
  each half waits only for its own input).
* Program order (the runtime's, pipeline/runtime/overlap.py): a chain is cut into segments after every all-to-all it
posts and at every block boundary (`TimedOp.switch`); an F&B pair issues F's first segment, then B's, then F's
  second, ... (DualPipe's hand-written interleaving: forward attention / dispatch / MLP / combine of one
  micro-batch against backward combine / MLP / dispatch / attention of the other). The backward half's W kernels
  (`deferrable`) are issued after both halves, at the end of the compute stream's queue, as the runtime does on
  CUDA (its halves' waits are stream dependencies, so it never sees a gap to fill; `PairRunner.run` issues the
  deferred weight-gradient closures after both halves); `wfill="program"` keeps each W where its backward
  produced it instead (DeepSeek-V3 Fig. 4: MLP(B), MLP(W), ATTN(B), ATTN(W)).
* Monotone physics (issue 32): the issue order is fixed before the pair runs; nothing depends on timing except
  the fluid rates. An earlier model back-filled a W into a wait when it was expected to end before the waiting
  kernel's input: a greedy, non-preemptive list scheduler, which has Graham's anomalies. More NVLink bandwidth
  shortened a dispatch wait below the 736 us experts W-grad (paper-27b, H800, 160 -> 165 GB/s), the W lost its
  gap, ran at the pair's end, and the baseline pair got 3.6% slower. With a fixed order every start is a max of
  ready times and stream predecessors' ends, so shorter kernels never start anything later.
* Streams, CUDA semantics: each stream runs its kernels one at a time in issue order; a kernel starts when its
  stream is free and its dependencies (explicit events across streams) are done. "hp" is the high-priority
  compute stream (the MLP-side mHC post+res and its backward, mhc.md §6); with `hp=False` its kernels are issued
  to the compute stream instead.
* Two shared resources, SMs and HBM bandwidth (a fluid model): at full rate a kernel occupies a share `sm` of
  the SMs and `hbm` of the peak bandwidth (Pricer derives both from its roofline: a compute-bound GEMM fills the
  SMs, a memory-bound kernel needs `bandwidth_sm_share` of them for its bandwidth). Running kernels are served in
  priority order: the all-to-all's fixed SM carve-out (`comm_share` = comm_sms / sms) first, then kernels that
  never yield (`preemptible=False`: persistent kernels, and large cuBLAS GEMMs, which did not yield to a
  high-priority stream on Hopper, gpu.md §6) in the order they started, then the hp stream, then the compute
  stream; each runs at rate min(1, SMs left / sm, HBM left / hbm). So a memory-bound kernel next to a GEMM that
  yields runs at full speed and slows the GEMM only by the SMs it takes; next to one that never yields it gets the
  leftovers (none: it waits). Bounds, both labelled: co-running never takes longer than running the two back to
  back, and never less than the longer of the two. `corun=False` gives the SMs to one compute kernel at a time
  (hp first if the running kernel yields).
* Interference: beyond the carve-out, compute under a running all-to-all slows by 1 / (1 + sigma) (sigma = 0 is
  the optimistic bound).
* Modes: "streams" (the above), "serial" (every kernel back to back, all-to-all exposed: F&B = F + B as the
  DeepSeek figures draw it), "max" (F&B = max(F, B), each half computed in "streams" mode).

Outputs: the makespan, busy and exposed communication (comm time with no compute running: an output, never an
input), per chain the time its output is ready (`release`: the forward's last kernel, the backward's last
input-gradient kernel), and every kernel's start and end (`timeline`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable

MODES = ("streams", "serial", "max")
_EPS = 1e-12
COMM, HP, COMPUTE = 0, 1, 2  # run_streams' stream slots, in the order it starts kernels
_STREAMS = ("comm", "hp", "compute")
_SLOT = {name: k for k, name in enumerate(_STREAMS)}


@dataclass(frozen=True)
class TimedOp:
    name: str
    group: str
    stream: str  # compute | hp | comm
    duration: float  # alone, at full rate (us)
    deps: tuple[int, ...] = (-1,)  # offsets (negative) of the kernels of the same chain it waits for
    preemptible: bool = True  # False: holds its SMs until it ends (persistent kernels, large cuBLAS GEMMs)
    sm: float = 1.0  # share of the SMs it occupies at full rate
    hbm: float = 0.0  # share of the peak HBM bandwidth it draws at full rate
    switch: bool = False  # the running half hands the turn to the other half after issuing this kernel
    output: bool = False  # the chain's output (what the next stage receives) is ready when this kernel ends
    deferrable: bool = False  # weight-gradient work an F&B pair may defer into gaps

    def with_(self, **changes) -> TimedOp:
        """dataclasses.replace(self, **changes) without its walk over the fields on every call (pricing builds
        ~10^5 of these in a tune): the fields copied, `changes` over them (TimedOp has no __post_init__)."""
        assert changes.keys() <= _FIELDS, f"not TimedOp fields: {sorted(changes.keys() - _FIELDS)}"
        new = object.__new__(TimedOp)
        new.__dict__.update(self.__dict__, **changes)
        return new


_FIELDS = frozenset(f.name for f in fields(TimedOp))


@dataclass
class OverlapResult:
    makespan: float
    compute_busy: float
    comm_busy: float
    exposed_comm: float
    group_time: dict[str, float] = field(default_factory=dict)  # summed kernel durations per group
    release: tuple[float, ...] = ()  # per chain: when its output is ready (the chain's end when unmarked)
    # the timeline's rows, or a function that makes them: the tuner runs ~3,000 of these and reads none
    rows: list[tuple[int, str, str, float, float]] | Callable[[], list] = field(default_factory=list, repr=False)

    @property
    def timeline(self) -> list[tuple[int, str, str, float, float]]:
        """Every kernel's (chain, name, stream, start, end), made when first read."""
        if callable(self.rows):
            self.rows = self.rows()
        return self.rows


def _group_time(chains: list[list[TimedOp]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for chain in chains:
        for op in chain:
            out[op.group] = out.get(op.group, 0.0) + op.duration
    return out


def _segments(chain: list[TimedOp], pair: bool) -> tuple[list[list[int]], list[int]]:
    """(program segments of op indices, deferred W indices), indices within the chain."""
    segs: list[list[int]] = [[]]
    deferred: list[int] = []
    for i, op in enumerate(chain):
        if pair and op.deferrable:
            deferred.append(i)
            continue
        segs[-1].append(i)
        if op.switch or op.stream == "comm":
            segs.append([])
    return [s for s in segs if s], deferred


WFILL = ("end", "program")


class Chain(list):
    """A chain of TimedOps that keeps what run_streams derives from it alone (_Prepared), made on its first run:
    a pricer runs each of its chains many times (alone, in pairs, with lags) and never changes them."""

    __slots__ = ("prepared",)

    def __init__(self, ops=()):
        super().__init__(ops)
        self.prepared: _Prepared | None = None


class _Prepared:
    """One chain's per-op values, its dependency graph (successors, predecessors to wait for), its segments alone
    and inside a pair, its output ops and its time per group."""

    __slots__ = ("n", "succ", "missing", "dur", "sm", "hbm", "pinned", "stream", "solo", "segments", "marked",
                 "group", "_alone")

    def __init__(self, chain: list[TimedOp]):
        n = self.n = len(chain)
        succ: list[list[int]] = [[] for _ in chain]
        missing = [0] * n
        for i, op in enumerate(chain):
            for off in op.deps:
                j = i + off
                if off < 0 and 0 <= j < n:
                    succ[j].append(i)
                    missing[i] += 1
        self.succ, self.missing = succ, missing
        self.dur = [op.duration for op in chain]
        self.sm = [op.sm for op in chain]
        self.hbm = [op.hbm for op in chain]
        self.pinned = [not op.preemptible for op in chain]
        self.stream = [op.stream for op in chain]
        # each op's rate running alone, _rates with nothing beside it (an all-to-all at 1; a compute kernel with
        # every SM and all the bandwidth: the carve-out, sigma and co-running need a second kernel): ~85% of events
        self.solo = [1.0 if st == "comm" else _fill(1.0, 1.0, op.sm, op.hbm) for st, op in zip(self.stream, chain)]
        self.segments = {pair: _segments(chain, pair) for pair in (False, True)}
        self.marked = [i for i, op in enumerate(chain) if op.output] or list(range(n))
        self.group = _group_time([chain])
        self._alone: dict[bool, tuple[list[int], list[list[int]]]] = {}

    def alone(self, hp: bool) -> tuple[list[int], list[list[int]]]:
        """The chain run alone: each op's stream slot and the slots' queues in issue order (_issue_order of it)."""
        got = self._alone.get(hp)
        if got is None:
            slot = _slots(self.stream, hp)
            order = [i for seg in self.segments[False][0] for i in seg]
            got = self._alone[hp] = (slot, _queues(order, slot))
        return got


def _slots(streams: list[str], hp: bool) -> list[int]:
    """Each op's stream slot: hp kernels on the compute stream without the hp stream."""
    return [_SLOT["compute" if (s == "hp" and not hp) else s] for s in streams]


def _queues(order: list[int], slot: list[int]) -> list[list[int]]:
    """Each slot's ops in issue order."""
    queues: list[list[int]] = [[], [], []]
    for i in order:
        queues[slot[i]].append(i)
    return queues


def _prepared(chain: list[TimedOp]) -> _Prepared:
    got = getattr(chain, "prepared", None)
    if got is None:
        got = _Prepared(chain)
        if isinstance(chain, Chain):
            chain.prepared = got
    return got


def _issue_order(chains: list[list[TimedOp]], pair: bool, b_first: bool = False) -> list[int]:
    """The order ops are issued in, as indices into the chains' ops in one list (chain c's op i at the summed
    lengths of the chains before it, + i): the halves' segments alternate, F first (B first with `b_first`); with
    `pair`, deferred W kernels are issued after both halves, in their order."""
    parts = []
    base = 0
    for chain in chains:
        segs, deferred = _prepared(chain).segments[pair]
        parts.append((segs, deferred, base))
        base += len(chain)
    if b_first:
        parts.reverse()
    order: list[int] = []
    for k in range(max((len(p[0]) for p in parts), default=0)):
        for segs, _, b in parts:
            if k < len(segs):
                order.extend([b + i for i in segs[k]] if b else segs[k])
    return order + [b + i for _, d, b in parts for i in d]


def run_streams(chains: list[list[TimedOp]], sigma: float = 0.0, hp: bool = True, *, corun: bool = True,
                comm_share: float = 0.0, lags: tuple[float, ...] | None = None, wfill: str = "end",
                b_first: bool = False) -> OverlapResult:
    if wfill not in WFILL:
        raise ValueError(f"wfill {wfill!r}: choose one of {', '.join(WFILL)}")
    lag = [0.0] * len(chains) if lags is None else [max(0.0, float(x)) for x in lags]
    # per op, and the streams as list slots (COMM, HP, COMPUTE: the order kernels are started in), from each chain's
    # _Prepared: this loop runs ~100 events per pair and the tuner prices ~10^3 pairs
    preps = [_prepared(chain) for chain in chains]
    base: list[int] = []
    chain_of: list[int] | None = None  # None: one chain
    if len(preps) == 1:
        p = preps[0]
        base.append(0)
        succ, missing, dur, sm, hbm, pinned, solo = p.succ, p.missing[:], p.dur, p.sm, p.hbm, p.pinned, p.solo
        slot, queues = p.alone(hp)
        op_lag = [lag[0]] * p.n
    else:
        succ, missing, dur, sm, hbm, pinned, solo, streams, chain_of = [], [], [], [], [], [], [], [], []
        for c, p in enumerate(preps):
            b = len(dur)
            base.append(b)
            succ += [[b + j for j in s] for s in p.succ] if b else p.succ
            missing += p.missing
            dur += p.dur
            sm += p.sm
            hbm += p.hbm
            pinned += p.pinned
            solo += p.solo
            streams += p.stream
            chain_of += [c] * p.n
        slot = _slots(streams, hp)
        op_lag = [lag[c] for c in chain_of]
        queues = _queues(_issue_order(chains, pair=wfill == "end", b_first=b_first), slot)
    N = len(dur)
    head = [0, 0, 0]
    running: list[list | None] = [None, None, None]  # per slot: [op, remaining full-rate work, start, start order]
    n_running = 0
    start_at = [0.0] * N
    end_at = [0.0] * N
    t = 0.0
    done = 0
    started = 0
    busy_c = busy_m = exposed = 0.0
    inf = float("inf")
    finish = [inf, inf, inf]
    later = [x for x in lag if x > 0.0]  # the lags that can be events (one at 0 never is: t >= 0)

    while done < N:
        # start what can start: each stream's next kernel in issue order (fixed before the run: no timing-dependent
        # choice, see "Monotone physics" in the module docstring)
        for s in (COMM, HP, COMPUTE):
            if running[s] is not None:
                continue
            q, h = queues[s], head[s]
            if h < len(q):
                i = q[h]
                if missing[i] == 0 and t + _EPS >= op_lag[i]:
                    head[s] = h + 1
                    running[s] = [i, dur[i], t, started]
                    n_running += 1
                    start_at[i] = t
                    started += 1
        if not n_running:
            pending = [op_lag[i] for i in range(N) if missing[i] == 0 and not end_at[i] and op_lag[i] > t]
            if not pending:
                raise RuntimeError("overlap: kernels wait on each other (bad deps); this is a cost-model bug")
            t = min(pending)
            continue
        if n_running == 1:  # one kernel alone (~85% of a tune's events): its solo rate, the steps below for it
            s = COMM if running[COMM] is not None else HP if running[HP] is not None else COMPUTE
            entry = running[s]
            r = solo[entry[0]]
            if r > 0:
                f = t_next = t + entry[1] / r
                for x in later:
                    if x > t + _EPS and x < t_next:
                        t_next = x
                dt = t_next - t
                if s == COMM:
                    busy_m += dt
                    exposed += dt
                else:
                    busy_c += dt
                t = t_next
                entry[1] -= dt * r
                if f <= t_next * (1 + 1e-12) + _EPS:
                    i = entry[0]
                    running[s] = None
                    n_running = 0
                    end_at[i] = t if t > 0 else _EPS
                    done += 1
                    for j in succ[i]:
                        missing[j] -= 1
                continue
        rates = _rates(sm, hbm, pinned, running, sigma, corun, comm_share)
        t_next = inf
        computing = False
        for s in (COMM, HP, COMPUTE):
            e = running[s]
            r = rates[s]
            if e is not None and r > 0:
                f = finish[s] = t + e[1] / r
                if f < t_next:
                    t_next = f
                if s != COMM:
                    computing = True
            else:
                finish[s] = inf
        for x in later:
            if x > t + _EPS and x < t_next:
                t_next = x
        if t_next == inf:
            raise RuntimeError("overlap: running kernels make no progress; this is a cost-model bug")
        dt = t_next - t
        if computing:
            busy_c += dt
        if running[COMM] is not None:
            busy_m += dt
            if not computing:
                exposed += dt
        t = t_next
        limit = t_next * (1 + 1e-12) + _EPS
        for s in (COMM, HP, COMPUTE):
            entry = running[s]
            if entry is None:
                continue
            entry[1] -= dt * rates[s]
            # finished: its own end is this event (decided on the end times, not on the leftover work, which
            # rounding leaves a hair above zero at large t)
            if finish[s] <= limit:
                i = entry[0]
                running[s] = None
                n_running -= 1
                end_at[i] = t if t > 0 else _EPS
                done += 1
                for j in succ[i]:
                    missing[j] -= 1
    release = tuple(max((end_at[base[c] + i] for i in p.marked), default=0.0) for c, p in enumerate(preps))
    group = dict(preps[0].group) if len(preps) == 1 else _group_time(chains)  # summed in _group_time's order
    return OverlapResult(t, busy_c, busy_m, exposed, group, release,
                         lambda: [(0 if chain_of is None else chain_of[i], op.name, _STREAMS[slot[i]], start_at[i],
                                   end_at[i])
                                  for i, op in enumerate(op for chain in chains for op in chain)])


def _rates(sm: list[float], hbm: list[float], pinned: list[bool], running: list, sigma: float, corun: bool,
           comm_share: float) -> list[float]:
    """Rates of the running kernels per stream slot (see the module docstring; 0.0 for an idle slot): carve-out,
    kernels that never yield (in start order), hp, compute; each min(1, SMs left / sm, HBM left / hbm). `sm`,
    `hbm`, `pinned`: per op, its TimedOp's sm, hbm and not preemptible (lists: this runs at every event)."""
    rates = [0.0, 0.0, 0.0]
    sm_left, hbm_left = 1.0, 1.0
    comm = running[COMM] is not None
    if comm:
        rates[COMM] = 1.0
        sm_left -= comm_share
    slow = 1.0 / (1.0 + sigma) if comm else 1.0
    on_hp, on_compute = running[HP], running[COMPUTE]
    if on_hp is None:
        compute: tuple[int, ...] = () if on_compute is None else (COMPUTE,)
    elif on_compute is None:
        compute = (HP,)
    elif pinned[on_compute[0]] and on_compute[3] < on_hp[3]:
        compute = (COMPUTE, HP)  # a kernel that never yields keeps the SMs it took before the hp kernel came
    else:
        compute = (HP, COMPUTE)
    granted = False
    for s in compute:
        i = running[s][0]
        if granted and not corun:
            rates[s] = 0.0
            continue
        s_i, h_i = sm[i], hbm[i]
        r = _fill(sm_left, hbm_left, s_i, h_i)
        sm_left -= r * s_i
        hbm_left -= r * h_i
        rates[s] = r * slow
        granted = granted or r > 0
    return rates


def _fill(sm_left: float, hbm_left: float, sm: float, hbm: float) -> float:
    """A kernel's rate from the SMs and HBM bandwidth left: min(1, SMs left / sm, HBM left / hbm), the comparisons
    written out."""
    r = 1.0
    if sm > 0:
        q = (sm_left if sm_left > 0.0 else 0.0) / sm
        if q < r:
            r = q
    if hbm > 0:
        q = (hbm_left if hbm_left > 0.0 else 0.0) / hbm
        if q < r:
            r = q
    return r


def floor(chains: list[list[TimedOp]], mode: str = "streams", hp: bool = True) -> float:
    """A lower bound on overlap(chains, mode, ...)'s makespan with no lags, for any sigma, co-running and carve-out,
    without running the streams: no kernel runs faster than its full rate, so the action lasts at least each chain's
    longest path of dependencies and each stream's summed kernels (both halves' kernels share a stream, except in
    mode "max", which times each half alone). The tuner skips the stream runs of layouts this bound prunes."""
    out = 0.0
    per_stream = [0.0, 0.0, 0.0]
    for chain in chains:
        if mode == "max":
            per_stream = [0.0, 0.0, 0.0]
        end: list[float] = []
        for i, op in enumerate(chain):
            t = 0.0
            for off in op.deps:
                if off < 0 and i + off >= 0 and end[i + off] > t:
                    t = end[i + off]
            end.append(t + op.duration)
            per_stream[_SLOT["compute" if (op.stream == "hp" and not hp) else op.stream]] += op.duration
        out = max(out, max(end, default=0.0), *per_stream)
    return out


def run_serial(chains: list[list[TimedOp]]) -> OverlapResult:
    comm = sum(op.duration for chain in chains for op in chain if op.stream == "comm")
    total = sum(op.duration for chain in chains for op in chain)
    release, t, timeline = [], 0.0, []
    for c, chain in enumerate(chains):
        out = None
        for op in chain:
            timeline.append((c, op.name, op.stream, t, t + op.duration))
            t += op.duration
            if op.output:
                out = t
        release.append(t if out is None else out)
    return OverlapResult(total, total - comm, comm, comm, _group_time(chains), tuple(release), timeline)


def overlap(chains: list[list[TimedOp]], mode: str = "streams", sigma: float = 0.0, hp: bool = True, *,
            corun: bool = True, comm_share: float = 0.0, lags: tuple[float, ...] | None = None,
            wfill: str = "end", b_first: bool = False) -> OverlapResult:
    """Duration of one action made of `chains` (1 chain, or 2 for an F&B step); see the module docstring."""
    if mode not in MODES:
        raise ValueError(f"unknown overlap mode {mode!r}; choose one of {', '.join(MODES)}")
    if wfill not in WFILL:
        raise ValueError(f"wfill {wfill!r}: choose one of {', '.join(WFILL)}")
    if mode == "serial":
        res = run_serial(chains)
        if lags and len(chains) > 1 and any(lags):  # F after its input, then B after its input
            f_end = max(lags[0], 0.0) + sum(op.duration for op in chains[0])
            start_b = max(f_end, lags[1])
            f_rel = res.release[0] + max(lags[0], 0.0)
            b_rel = start_b + res.release[1] - sum(op.duration for op in chains[0])
            return OverlapResult(start_b + sum(op.duration for op in chains[1]), res.compute_busy, res.comm_busy,
                                 res.exposed_comm, res.group_time, (f_rel, b_rel), res.timeline)
        return res
    kw = dict(corun=corun, comm_share=comm_share, wfill=wfill)
    if mode == "max" and len(chains) > 1:
        parts = [run_streams([c], sigma, hp, lags=None if lags is None else (lags[k],), **kw)
                 for k, c in enumerate(chains)]
        best = max(parts, key=lambda r: r.makespan)
        timeline = [(k, *row[1:]) for k, p in enumerate(parts) for row in p.timeline]
        return OverlapResult(best.makespan, sum(p.compute_busy for p in parts), sum(p.comm_busy for p in parts),
                             best.exposed_comm, _group_time(chains), tuple(p.release[0] for p in parts), timeline)
    return run_streams(chains, sigma, hp, lags=lags, b_first=b_first and len(chains) > 1, **kw)
