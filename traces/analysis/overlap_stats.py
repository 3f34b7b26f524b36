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

from dataclasses import asdict, dataclass, field

import numpy as np

from traces.analysis.matching import logical_stream
from traces.names import ALL_COMM_KINDS, LOGICAL_STREAMS, RANGE_KIND, STEP_KIND, WAIT_KIND
from traces.columns import Columns, columns_of
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


def classify(trace: Trace, idx: np.ndarray, cols: Columns, category: np.ndarray) -> tuple[str, np.ndarray, np.ndarray,
                                                                                        np.ndarray, np.ndarray]:
    """(basis, communication, compute, blocked (WAIT), unmatched) span indices of one rank (`idx`, in trace
    order); `category`: every span's in the ops basis (_categories)."""
    kernel = cols.kinds.index("kernel") if "kernel" in cols.kinds else -1
    if kernel >= 0 and np.any(cols.kind[idx] == kernel):
        is_kernel = cols.kind[idx] == kernel  # an NCCL kernel: a kernel whose name says nccl
        nccl = np.fromiter(("nccl" in name.lower() for name in trace.field("name", idx)), bool, len(idx))
        none = np.empty(0, dtype=np.int64)
        return "kernels", idx[is_kernel & nccl], idx[is_kernel & ~nccl], none, idx[~is_kernel]
    c = category[idx]
    return "ops", idx[c == 1], idx[c == 2], idx[c == 0], idx[c == 3]


def _category(s: Span) -> int:
    """0 blocked (WAIT), 1 communication, 2 compute, 3 unmatched, 4 left out (step marks)."""
    op = s.kind.split(".", 1)[0]
    ls = logical_stream(s) if s.kind not in (RANGE_KIND, STEP_KIND) else None
    if s.kind == WAIT_KIND:
        return 0
    if ls == "comm" and op in ALL_COMM_KINDS:
        return 1
    if ls in ("compute", "hp") and op in COMPUTE_OPS:
        return 2
    return 3 if s.kind != STEP_KIND else 4


def _categories(trace: Trace, cols: Columns) -> np.ndarray:
    """Every span's _category: once per (kind, stream) where those decide it (a logical stream, or a range or step
    mark), per span only where the label does (a reader's own stream name)."""
    pairs = cols.kind * len(cols.streams) + cols.stream
    out = np.empty(len(cols), dtype=np.int64)
    for p in np.unique(pairs).tolist():
        at = np.flatnonzero(pairs == p)
        kind, stream = cols.kinds[p // len(cols.streams)], cols.streams[p % len(cols.streams)]
        if stream in LOGICAL_STREAMS or kind in (RANGE_KIND, STEP_KIND):
            out[at] = _category(trace.span(int(at[0])))
        else:
            out[at] = [_category(s) for s in trace.spans_at(at)]
    return out


def _union(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals [a_i, b_i] as disjoint sorted ones: sorted by (start, end), a new one begins where a
    start lies beyond every end before it (an interval touching the previous one joins it)."""
    if not len(a):
        return a, b
    order = np.lexsort((b, a))
    a, b = a[order], b[order]
    reach = np.maximum.accumulate(b)
    begins = np.flatnonzero(np.concatenate(([True], a[1:] > reach[:-1])))
    ends = np.concatenate((begins[1:] - 1, [len(a) - 1]))
    return a[begins], reach[ends]


def _minus(a: np.ndarray, b: np.ndarray, ca: np.ndarray, cb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint sorted intervals [a, b] without the disjoint sorted intervals [ca, cb]: their intersections of
    positive length with the gaps between the cut intervals, in order."""
    if not len(ca) or not len(a):
        return a, b
    gap_a = np.concatenate(([-np.inf], cb))  # the gaps of the cut: before the first, between, after the last
    gap_b = np.concatenate((ca, [np.inf]))
    first = np.searchsorted(gap_b, a, side="right")  # the first gap ending after the interval starts
    stop = np.searchsorted(gap_a, b, side="left")  # the first gap starting at or after the interval ends
    n = np.maximum(stop - first, 0)
    owner = np.repeat(np.arange(len(a)), n)
    gap = np.repeat(first, n) + (np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n))
    lo = np.maximum(a[owner], gap_a[gap])
    hi = np.minimum(b[owner], gap_b[gap])
    keep = lo < hi
    return lo[keep], hi[keep]


def _covered(us: np.ndarray, ue: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per interval [a_i, b_i]: its length inside the disjoint sorted intervals [us, ue]. Vectorised over the
    intervals, one union interval a round; each total adds its pieces in the same order as a loop over the
    union would (0.0 + first piece + second ...), so the sums are that loop's to the last bit."""
    total = np.zeros(len(a))
    if not len(us) or not len(a):
        return total
    first = np.maximum(np.searchsorted(us, a, side="right") - 1, 0)
    stop = np.searchsorted(us, b, side="left")  # the first union interval starting at or after b
    act = np.flatnonzero(first < stop)
    j = 0
    while len(act):
        i = first[act] + j
        lo = np.maximum(a[act], us[i])
        hi = np.minimum(b[act], ue[i])
        total[act] += np.where(hi > lo, hi - lo, 0.0)
        j += 1
        act = act[first[act] + j < stop[act]]
    return total


def _groups(keys: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """(a code per element, the codes' keys in order of first appearance): the dicts' order a loop would make."""
    uniq, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    rank_of = np.empty(len(uniq), dtype=np.int64)
    rank_of[np.argsort(first, kind="stable")] = np.arange(len(uniq))
    return rank_of[inverse.reshape(-1)], uniq[np.argsort(first, kind="stable")].tolist()


def _add_shares(shares: dict, keys: list, codes: np.ndarray, dur: np.ndarray, ov: np.ndarray) -> None:
    """Per group, its spans' count and their durations and overlaps summed in trace order (bincount adds them one
    by one, as a loop would)."""
    n = len(keys)
    counts = np.bincount(codes, minlength=n).tolist()
    comm_us = np.bincount(codes, weights=dur, minlength=n).tolist()
    ov_us = np.bincount(codes, weights=ov, minlength=n).tolist()
    for c, k in enumerate(keys):
        sh = shares.setdefault(k, Share())
        sh.spans, sh.comm_us, sh.overlapped_us = sh.spans + counts[c], comm_us[c], ov_us[c]


def overlap_stats(trace: Trace) -> OverlapStats:
    cols = columns_of(trace)
    end = cols.end
    category = _categories(trace, cols)
    order = np.argsort(cols.rank, kind="stable")  # each rank's spans in trace order
    ranks, bounds = np.unique(cols.rank[order], return_index=True)
    bounds = np.append(bounds, len(order))
    basis, per_rank, per_stream, by_name, unmatched = {}, {}, {}, {}, {}
    notes: list[str] = []
    for j, r in enumerate(ranks.tolist()):
        b, comm, comp, blocked, other = classify(trace, order[bounds[j]:bounds[j + 1]], cols, category)
        basis[r] = b
        us, ue = _minus(*_union(cols.start[comp], end[comp]), *_union(cols.start[blocked], end[blocked]))
        ca, cb = _union(cols.start[comm], end[comm])
        tot = Share()
        tot.wall_us = sum((cb - ca).tolist())
        ov = _covered(us, ue, cols.start[comm], end[comm])
        dur = cols.duration[comm]
        codes, streams = _groups(cols.stream[comm])
        _add_shares(per_stream, [(r, cols.streams[k]) for k in streams], codes, dur, ov)
        if b == "kernels":
            names = trace.field("name", comm)
            index: dict[str, int] = {}
            codes = np.fromiter((index.setdefault(n, len(index)) for n in names), np.int64, len(names))
            keys = [(r, n) for n in index]
        else:  # by op: kinds of one op (A2A_DISPATCH and A2A_DISPATCH.part) share a group
            ops = list(dict.fromkeys(k.split(".", 1)[0] for k in cols.kinds))
            op_of_kind = np.asarray([ops.index(k.split(".", 1)[0]) for k in cols.kinds], dtype=np.int64)
            codes, first = _groups(op_of_kind[cols.kind[comm]])
            keys = [(r, ops[c]) for c in first]
        _add_shares(by_name, keys, codes, dur, ov)
        if len(comm):
            _add_shares(per_rank, [r], np.zeros(len(comm), dtype=np.int64), dur, ov)
            per_rank[r].wall_us = tot.wall_us
        else:
            per_rank[r] = tot
        u: dict[str, dict[str, float]] = {}
        for s in trace.spans_at(other):
            key = f"{s.kind}: {s.label if s.kind not in GPU_OPS else s.name or s.kind}"
            d = u.setdefault(key, {"count": 0, "us": 0.0})
            d["count"] += 1
            d["us"] += s.duration
        unmatched[r] = dict(sorted(u.items(), key=lambda kv: -kv[1]["us"]))
        if len(comm) and not len(comp):
            notes.append(f"rank {r}: {len(comm)} communication spans but no compute to overlap with")
        if not len(comm):
            notes.append(f"rank {r}: no communication spans ({'no NCCL kernels' if b == 'kernels' else 'no comm ops'})")
    if trace.meta.get("p2p_completion") == "at the wait":
        notes.append("this run's P2P spans end when a wait saw them complete (gloo on CPU), so their overlap counts "
                     "time after the message arrived")
    return OverlapStats(basis, per_rank, per_stream, by_name, unmatched, notes)
