"""The F&B cost model checked against runs: calibrate a pair's chains on a serial run's trace, predict the
overlapped run (costmodel.md §3: calibrated on a run that is not the quantity predicted).

A serial F&B pair (`--no-overlap`, pipeline/runtime/executor.py) runs the forward half, then the backward half, each
expert-parallel all-to-all waited right after its post. Its trace therefore shows every piece of the pair one
after the other: compute, an all-to-all from post to completion (`~comm` span, fully exposed), compute, ...
From one serial pair (`FB/s<f>/mb<i>+s<b>/mb<j>` span on a rank, with its `F/...` and `B/...` half spans):
* the forward chain covers [FB start, B half start), the backward chain [B half start, FB end), so the two chains
  sum to the measured pair exactly (`serial` mode reproduces it);
* a chain is cut at every all-to-all posted in it: compute (the time between, on the host thread) and the
  all-to-all (post to completion, clipped to the chain); in the forward also at every MLP sub-layer's end (its
  `post_res~hp` span, recorded inline on CPU): the block boundaries where the runtime's halves switch too
  (pipeline/runtime/overlap.py). The backward's block boundaries are not in a serial trace (its weight-gradients run
  inline, not deferred): its chain is cut only at its all-to-alls, and none of its work is `deferrable`.
* pair kind = (forward stage, backward stage); per kind the chains are the medians, op by op, over the steady
  steps' pairs of every rank that share the kind's most common structure (the same ops in the same order),
  scaled by one factor so that they sum to the median of those pairs' durations: the quantity compared is a
  median pair, and op times are right-skewed (host noise), so the sum of the op medians falls short of it
  (by 10-17% in the tiny-moe run of bench/predict_overlap_cpu.py).

Prediction (`predict`), the pair serial (`costmodel.pricing.fb_overlap` "serial") and overlapped two ways:
* "streams": `costmodel.pricing.fb_overlap.overlap(chains, "streams")`, the cost model as it prices GPU pairs
(compute on
  one "compute" stream with sm=1, hbm=0: a CPU rank has one host thread and no bandwidth model; all-to-alls on
  the one "comm" stream; the halves' segments in their fixed alternating issue order);
* "turns": `turns`, the CPU runtime's own hand-over policy (pipeline/runtime/overlap.py, `dynamic` on CPU): the thread
  goes to whichever half can compute, and the two halves' all-to-alls fly at the same time.
Predicted comm hidden % = 100 * (1 - exposed / comm): the share of all-to-all time with compute running, which
is what the measured definition (traces.analysis.comm_overlap: an op's time not covered by the compute thread's WAIT
spans) counts.

Measured (`measure_pairs`, the overlapped or the serial trace): per kind the F&B span durations, the all-to-all
hidden % of the ops posted inside the pairs (traces.analysis.comm_overlap's definition, per kind), and the time the pair
waited for its own inputs inside its span (overlapped pairs wait for their receives inside, serial ones before).

Host check (`cores_taken_pct`): the model gives each rank a core. On a host with more busy ranks than cores, the
serial pairs' all-to-all waiting that had every core busy with other ranks cannot be hidden without taking a core
from another rank; the share of such waiting says how far the prediction can be trusted there.

Shape letters: none (scalars and spans only).
"""
from __future__ import annotations

import bisect
import re
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from costmodel.pricing.fb_overlap import TimedOp, overlap
from traces.names import A2A_KINDS, WAIT_KIND
from traces.trace import Span, Trace

PairKind = tuple[int, int]  # (forward stage, backward stage)
_A2A_RE = re.compile(r"^(?P<op>[A-Z_0-9]+)/s\d+/mb\d+(?P<rest>/L[^~]*)?~comm$")


@dataclass(frozen=True)
class PairSample:
    """One serial F&B pair cut into its ops: (name, stream, duration us, switch) per half."""

    rank: int
    kind: PairKind
    duration: float
    halves: tuple[tuple[tuple[str, str, float, bool], ...], tuple[tuple[str, str, float, bool], ...]]

    @property
    def structure(self) -> tuple:
        return tuple(tuple((n, s, sw) for n, s, _, sw in h) for h in self.halves)


@dataclass
class PairMeasure:
    """Measured pairs of one kind."""

    durations: list[float] = field(default_factory=list)
    a2a_us: float = 0.0  # summed all-to-all durations (post to completion) posted inside the pairs
    a2a_exposed_us: float = 0.0  # WAIT time of the compute thread on them
    input_wait_us: list[float] = field(default_factory=list)  # per pair: WAIT on its receives inside its span
    # per pair, where an overlapped pair's time went (a serial pair has no segment spans: segment_us 0):
    segment_us: list[float] = field(default_factory=list)  # the halves' compute stretches (F.* / B.* spans)
    blocked_us: list[float] = field(default_factory=list)  # every WAIT span inside
    pair_a2a_us: list[float] = field(default_factory=list)  # its all-to-alls' summed durations

    @property
    def median_us(self) -> float:
        return statistics.median(self.durations)

    @property
    def hidden_pct(self) -> float | None:
        if self.a2a_us <= 0:
            return None
        return 100.0 * (1.0 - min(self.a2a_exposed_us, self.a2a_us) / self.a2a_us)


def steady(trace: Trace, warmup: int) -> Trace:
    """The trace without each rank's spans that start before its step `warmup` began."""
    begin = {s.rank: s.start for s in trace.spans if s.kind == "step" and s.label == f"step/{warmup}"}
    if not begin:
        raise ValueError(f"warmup={warmup}: the trace has no step/{warmup} span; pass a warm-up below its step count")
    return Trace([s for s in trace.spans if s.start >= begin.get(s.rank, float("inf"))], dict(trace.meta))


def _is_a2a(s: Span) -> bool:
    return s.stream == "comm" and s.kind.split(".", 1)[0] in A2A_KINDS


def _op_name(s: Span) -> str:
    m = _A2A_RE.match(s.label)
    return f"{m['op']}{m['rest'] or ''}" if m else s.kind


def _pairs(trace: Trace):
    """Per rank: (FB span, the spans that start inside it), FB spans in time order."""
    by_rank: dict[int, list[Span]] = defaultdict(list)
    for s in trace.spans:
        by_rank[s.rank].append(s)
    for rank, spans in sorted(by_rank.items()):
        spans.sort(key=lambda s: s.start)
        for fb in (s for s in spans if s.kind == "FB"):
            if fb.partner is None:
                raise ValueError(f"span {fb.label} on rank {rank}: an FB span needs its partner (backward half)")
            yield rank, fb, [s for s in spans if s is not fb and fb.start <= s.start <= fb.end]


def _chain(t0: float, t1: float, a2as: list[Span], cuts: list[float], side: str):
    """Ops of one half over [t0, t1): compute between the all-to-alls (cut at `cuts`, switch there), the
    all-to-alls from post to completion (clipped)."""
    ops: list[tuple[str, str, float, bool]] = []
    t = t0

    def compute_until(end: float) -> None:
        nonlocal t
        for c in sorted(x for x in cuts if t < x < end):
            ops.append((f"{side}.c{len(ops)}", "compute", c - t, True))
            t = c
        ops.append((f"{side}.c{len(ops)}", "compute", max(0.0, end - t), False))
        t = max(t, end)

    for a in a2as:
        compute_until(min(max(a.start, t), t1))
        end = min(a.end, t1)
        ops.append((_op_name(a), "comm", max(0.0, end - t), False))
        t = max(t, end)
    compute_until(t1)
    return tuple(ops)


def serial_samples(trace: Trace) -> list[PairSample]:
    """Every serial F&B pair of the trace cut into its two chains (see the module docstring)."""
    out = []
    for rank, fb, inside in _pairs(trace):
        b_half = [s for s in inside if s.kind == "B" and s.stream == "compute"]
        if len(b_half) != 1:
            raise ValueError(f"span {fb.label} on rank {rank}: a serial F&B pair needs one B half span inside "
                             f"(found {len(b_half)}); calibrate on a --no-overlap run's trace")
        split = b_half[0].start
        a2as = sorted((s for s in inside if _is_a2a(s)), key=lambda s: s.start)
        cuts = [s.end for s in inside if s.stream == "hp" and s.end < split]
        f_ops = _chain(fb.start, split, [a for a in a2as if a.start < split], cuts, "F")
        b_ops = _chain(split, fb.end, [a for a in a2as if a.start >= split], [], "B")
        out.append(PairSample(rank, (fb.stage, fb.partner[0]), fb.duration, (f_ops, b_ops)))
    return out


def chains(samples: list[PairSample]) -> dict[PairKind, tuple[list[list[TimedOp]], int]]:
    """Per kind: the two chains (median op durations over the samples of the most common structure, scaled to
    sum to those samples' median pair duration) and the number of samples used."""
    by_kind: dict[PairKind, list[PairSample]] = defaultdict(list)
    for s in samples:
        by_kind[s.kind].append(s)
    out = {}
    for kind, group in sorted(by_kind.items()):
        common, _ = Counter(s.structure for s in group).most_common(1)[0]
        used = [s for s in group if s.structure == common]
        med = [[statistics.median(s.halves[h][i][2] for s in used) for i in range(len(ops))]
               for h, ops in enumerate(common)]
        total = sum(map(sum, med))
        scale = statistics.median(s.duration for s in used) / total if total > 0 else 1.0
        halves = []
        for h, ops in enumerate(common):
            chain = []
            for i, (name, stream, switch) in enumerate(ops):
                d = med[h][i] * scale
                group_name = "a2a" if stream == "comm" else "compute"
                chain.append(TimedOp(name, group_name, stream, d, sm=0.0 if stream == "comm" else 1.0, hbm=0.0,
                                     switch=switch))
            halves.append(chain)
        out[kind] = (halves, len(used))
    return out


@dataclass(frozen=True)
class PairPrediction:
    serial_us: float
    overlap_us: float
    hidden_pct: float | None  # all-to-all time with compute running, % of all-to-all time

    @property
    def gain(self) -> float:
        """serial / overlapped F&B duration (> 1: overlap pays)."""
        return self.serial_us / self.overlap_us


def predict(pair_chains: list[list[TimedOp]], mode: str = "streams") -> PairPrediction:
    """`mode` "streams": costmodel.pricing.fb_overlap (CUDA semantics: the compute stream runs the halves' segments
    in their
    fixed alternating issue order, all-to-alls one at a time on the comm stream); "turns": `turns`, the CPU
    runtime's hand-over policy."""
    serial = overlap(pair_chains, "serial")
    if mode == "turns":
        makespan, exposed, comm = turns(pair_chains)
    elif mode == "streams":
        over = overlap(pair_chains, "streams")
        makespan, exposed, comm = over.makespan, over.exposed_comm, over.comm_busy
    else:
        raise ValueError(f"unknown prediction mode {mode!r}; choose streams or turns")
    hidden = None if comm <= 0 else 100.0 * (1.0 - exposed / comm)
    return PairPrediction(serial.makespan, makespan, hidden)


def turns(pair_chains: list[list[TimedOp]]) -> tuple[float, float, float]:
    """(makespan, exposed comm, comm) of a pair run by pipeline/runtime/overlap.py's PairRunner on a CPU rank: one host
    thread computes one half at a time; a half posts an all-to-all and hands the turn over (after every post and
    at every `switch`); a half whose next compute needs an all-to-all still in flight hands the turn to the other
    half unless that one is itself parked on one, and then the thread blocks (a WAIT: exposed) until the first of
    them completes. All-to-alls fly concurrently (each half's exchanges have their own process group), each for
    its calibrated post-to-completion time. Deferred W fills are not modelled (the calibration has no W apart)."""
    ops = [list(c) for c in pair_chains]
    idx, end = [0] * len(ops), [[0.0] * len(c) for c in ops]
    t, turn, exposed = 0.0, 0, 0.0
    comm = sum(op.duration for c in ops for op in c if op.stream == "comm")

    def done(h: int) -> bool:
        return idx[h] >= len(ops[h])

    def parked_until(h: int) -> float:
        """When the comm that half h's next op needs completes (t or earlier: nothing to wait for)."""
        i = idx[h]
        return end[h][i - 1] if i > 0 and ops[h][i - 1].stream == "comm" else t

    while not all(done(h) for h in range(len(ops))):
        other = 1 - turn if len(ops) == 2 else turn
        if done(turn):
            turn = other
            continue
        op = ops[turn][idx[turn]]
        if op.stream == "comm":  # post it; it flies while the other half computes
            end[turn][idx[turn]] = t + op.duration
            idx[turn] += 1
            if not done(other):
                turn = other
            continue
        ready = parked_until(turn)
        if ready > t:
            if other != turn and not done(other) and parked_until(other) <= t:
                turn = other  # the other half can compute
                continue
            wake = min([ready] + ([parked_until(other)] if other != turn and not done(other) else []))
            if wake <= t:
                raise RuntimeError("turns: neither half can progress; this is a cost-model bug")
            exposed += wake - t
            t = wake
            continue
        t += op.duration
        end[turn][idx[turn]] = t
        idx[turn] += 1
        if (op.switch or done(turn)) and not done(other):
            turn = other
    return t, exposed, comm


def measure_pairs(trace: Trace) -> dict[PairKind, PairMeasure]:
    """Per kind: F&B span durations, all-to-all hidden % of the ops posted inside the pairs, input waits."""
    out: dict[PairKind, PairMeasure] = defaultdict(PairMeasure)
    for rank, fb, inside in _pairs(trace):
        m = out[(fb.stage, fb.partner[0])]
        m.durations.append(fb.duration)
        a2a = {s.label[:-5]: s for s in inside if _is_a2a(s)}
        waited: dict[str, float] = defaultdict(float)
        recv_wait = 0.0
        for w in inside:
            if w.kind != WAIT_KIND:
                continue
            target = w.label[5:] if w.label.startswith("WAIT/") else ""
            if target in a2a:
                waited[target] += w.duration
            elif target.startswith(("RECV_F/", "RECV_B/")):
                recv_wait += w.duration
        for name, s in a2a.items():
            m.a2a_us += s.duration
            m.a2a_exposed_us += min(waited[name], s.duration)
        m.input_wait_us.append(recv_wait)
        m.segment_us.append(sum(s.duration for s in inside if s.stream == "compute" and "." in s.kind
                                and s.kind.split(".", 1)[0] in ("F", "B")))
        m.blocked_us.append(sum(s.duration for s in inside if s.kind == WAIT_KIND))
        m.pair_a2a_us.append(sum(s.duration for s in a2a.values()))
    return dict(sorted(out.items()))


def hidden_pct(measures: dict[PairKind, PairMeasure]) -> float | None:
    """All kinds together (the same number as traces.analysis.comm_overlap's F&B all-to-all share)."""
    comm = sum(m.a2a_us for m in measures.values())
    exposed = sum(min(m.a2a_exposed_us, m.a2a_us) for m in measures.values())
    return None if comm <= 0 else 100.0 * (1.0 - exposed / comm)


def cores_taken_pct(trace: Trace, cores: int) -> float | None:
    """Of the time the ranks spent blocked on all-to-alls inside their F&B pairs, the share (%) during which at
    least `cores` other ranks were busy (inside a step span and not blocked in a WAIT span). In a serial run that
    is wait time the model counts as hideable under the other half's compute, but on this host the other half
    could only get a core by taking it from another rank: the model, which gives every rank a core, cannot hold
    there. The ranks' spans must share one clock (the runtime aligns them before recording). None without such
    waits or without step spans."""
    if cores < 1:
        raise ValueError(f"cores={cores}: pass the host's core count (>= 1)")
    edges: list[tuple[float, int, int]] = []  # (time, rank, +1 busy / -1 not)
    for s in trace.spans:
        if s.kind == "step":
            edges += [(s.start, s.rank, 1), (s.end, s.rank, -1)]
        elif s.kind == WAIT_KIND:
            edges += [(s.start, s.rank, -1), (s.end, s.rank, 1)]
    if not any(s.kind == "step" for s in trace.spans):
        return None
    edges.sort()
    times, busy_sets, level = [], [], defaultdict(int)
    for t, rank, d in edges:  # busy set right after each edge
        level[rank] += d
        times.append(t)
        busy_sets.append(frozenset(r for r, v in level.items() if v > 0))
    blocked = taken = 0.0
    for rank, _, inside in _pairs(trace):
        for w in inside:
            if w.kind != WAIT_KIND or not w.label.startswith("WAIT/A2A_"):
                continue
            blocked += w.duration
            i = bisect.bisect_right(times, w.start) - 1
            t = w.start
            while t < w.end:
                nxt = min(times[i + 1] if i + 1 < len(times) else w.end, w.end)
                if i >= 0 and len(busy_sets[i] - {rank}) >= cores:
                    taken += nxt - t
                t, i = nxt, i + 1
    return None if blocked <= 0 else 100.0 * taken / blocked
