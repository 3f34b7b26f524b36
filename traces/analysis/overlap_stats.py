"""Communication/compute overlap per rank and stream: for every communication span, the share of its time during
which the same rank was computing. Works on our traces and on imported ones (Nsight Systems, PyTorch profiler).

What counts, per rank:
  * a rank with GPU kernels (an imported GPU trace, or ours captured under a profiler): communication = the NCCL
    kernels, found by name (`nccl` in the kernel name, as Holistic Trace Analysis and Nsight Systems' NCCL
    recipes find them); compute = every other kernel. Memcpy/memset and ranges are neither.
  * a rank without kernels (our runtime's own spans, predictions): communication = the spans of communication
    ops on the comm stream (SEND/RECV, all-to-alls, gradient all-reduces: traces.names.ALL_COMM_KINDS); compute
    = the compute ops on the compute and hp streams (F, I, B, W, FB, RC, OPT and their parts), minus the time
    the compute thread was blocked (WAIT spans).
Everything neither communication nor compute is reported in `unmatched` (per rank: count and time by kind and
name), not dropped. overlapped(c) = |c ∩ union of the rank's compute|; share = overlapped / duration.

A measured SEND/RECV span runs from its post to its completion, which on CPU gloo is seen only at the wait
(traces.analysis.comm_overlap): its "overlap" then includes time after the message arrived (stated in `notes`).
"""
from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import asdict, dataclass, field

from traces.analysis.matching import logical_stream
from traces.names import ALL_COMM_KINDS, RANGE_KIND, STEP_KIND, WAIT_KIND
from traces.trace import Span, Trace

COMPUTE_OPS = frozenset({"F", "I", "B", "W", "FB", "RC", "OPT"})
GPU_OPS = ("kernel", "memcpy", "memset")


@dataclass
class Share:
    """comm_us sums the spans' durations (concurrent ones each count: the share's denominator); wall_us, set per
    rank, is the time at least one of them was in flight (their union), which a timeline shows."""

    spans: int = 0
    comm_us: float = 0.0
    overlapped_us: float = 0.0
    wall_us: float | None = None

    @property
    def overlap_pct(self) -> float | None:
        return 100.0 * self.overlapped_us / self.comm_us if self.comm_us > 0 else None

    def add(self, dur: float, ov: float) -> None:
        self.spans += 1
        self.comm_us += dur
        self.overlapped_us += ov

    def to_dict(self) -> dict:
        return {**asdict(self), "overlap_pct": self.overlap_pct}


@dataclass
class OverlapStats:
    basis: dict[int, str]  # rank -> "kernels" or "ops"
    per_rank: dict[int, Share]
    per_stream: dict[tuple[int, str], Share]
    by_name: dict[tuple[int, str], Share]  # (rank, comm kind or kernel name) -> share
    unmatched: dict[int, dict[str, dict[str, float]]]  # rank -> "kind: name" -> {count, us}
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"basis": {str(r): b for r, b in self.basis.items()},
                "per_rank": {str(r): s.to_dict() for r, s in self.per_rank.items()},
                "per_stream": [{"rank": r, "stream": st, **s.to_dict()}
                               for (r, st), s in sorted(self.per_stream.items())],
                "by_name": [{"rank": r, "name": n, **s.to_dict()} for (r, n), s in sorted(self.by_name.items())],
                "unmatched": {str(r): u for r, u in self.unmatched.items()}, "notes": self.notes}


def is_nccl(s: Span) -> bool:
    return s.kind == "kernel" and "nccl" in s.name.lower()


def classify(spans: list[Span]) -> tuple[str, list[Span], list[Span], list[Span], list[Span]]:
    """(basis, communication, compute, blocked (WAIT), unmatched) spans of one rank."""
    comm, comp, blocked, other = [], [], [], []
    if any(s.kind == "kernel" for s in spans):
        for s in spans:
            if s.kind == "kernel":
                (comm if is_nccl(s) else comp).append(s)
            else:
                other.append(s)
        return "kernels", comm, comp, blocked, other
    for s in spans:
        op = s.kind.split(".", 1)[0]
        ls = logical_stream(s) if s.kind not in (RANGE_KIND, STEP_KIND) else None
        if s.kind == WAIT_KIND:
            blocked.append(s)
        elif ls == "comm" and op in ALL_COMM_KINDS:
            comm.append(s)
        elif ls in ("compute", "hp") and op in COMPUTE_OPS:
            comp.append(s)
        elif s.kind != STEP_KIND:
            other.append(s)
    return "ops", comm, comp, blocked, other


def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _minus(iv: list[tuple[float, float]], cut: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint sorted intervals `iv` without the disjoint sorted intervals `cut`."""
    out = []
    j = 0
    for a, b in iv:
        while j < len(cut) and cut[j][1] <= a:
            j += 1
        k, cur = j, a
        while k < len(cut) and cut[k][0] < b:
            if cut[k][0] > cur:
                out.append((cur, cut[k][0]))
            cur = max(cur, cut[k][1])
            k += 1
        if cur < b:
            out.append((cur, b))
    return out


def _covered(union: list[tuple[float, float]], starts: list[float], a: float, b: float) -> float:
    i = max(bisect.bisect_right(starts, a) - 1, 0)
    total = 0.0
    while i < len(union) and union[i][0] < b:
        lo, hi = max(a, union[i][0]), min(b, union[i][1])
        if hi > lo:
            total += hi - lo
        i += 1
    return total


def overlap_stats(trace: Trace) -> OverlapStats:
    by_rank: dict[int, list[Span]] = defaultdict(list)
    for s in trace.spans:
        by_rank[s.rank].append(s)
    basis, per_rank, per_stream, by_name, unmatched = {}, {}, {}, {}, {}
    notes: list[str] = []
    for r, spans in sorted(by_rank.items()):
        b, comm, comp, blocked, other = classify(spans)
        basis[r] = b
        union = _minus(_union([(s.start, s.end) for s in comp]), _union([(s.start, s.end) for s in blocked]))
        starts = [a for a, _ in union]
        tot = per_rank[r] = Share()
        tot.wall_us = sum(b - a for a, b in _union([(s.start, s.end) for s in comm]))
        for s in comm:
            ov = _covered(union, starts, s.start, s.end)
            tot.add(s.duration, ov)
            per_stream.setdefault((r, s.stream), Share()).add(s.duration, ov)
            key = s.name if b == "kernels" else s.kind.split(".", 1)[0]
            by_name.setdefault((r, key), Share()).add(s.duration, ov)
        u: dict[str, dict[str, float]] = {}
        for s in other:
            key = f"{s.kind}: {s.label if s.kind not in GPU_OPS else s.name or s.kind}"
            d = u.setdefault(key, {"count": 0, "us": 0.0})
            d["count"] += 1
            d["us"] += s.duration
        unmatched[r] = dict(sorted(u.items(), key=lambda kv: -kv[1]["us"]))
        if comm and not comp:
            notes.append(f"rank {r}: {len(comm)} communication spans but no compute to overlap with")
        if not comm:
            notes.append(f"rank {r}: no communication spans ({'no NCCL kernels' if b == 'kernels' else 'no comm ops'})")
    if trace.meta.get("p2p_completion") == "at the wait":
        notes.append("this run's P2P spans end when a wait saw them complete (gloo on CPU), so their overlap counts "
                     "time after the message arrived")
    return OverlapStats(basis, per_rank, per_stream, by_name, unmatched, notes)
