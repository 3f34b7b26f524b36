"""Makespan and per-rank time budget of one trace, per step, then medians over the steps (compare, view).

A step is the k-th instance of every schedule span's key (traces.analysis.matching.key_groups); it counts when it
holds at least half the spans of the first step. Per counted step: the makespan (end of its last minus start of its
first span), per rank the busy time (the union of its compute and hp spans), the exposed communication (the union
with its comm spans, less busy), the time per kind of its top-level compute and hp spans with mHC kernel parts
carved out of their op, and (traces without WAIT spans) the time its compute waited for messages
(traces.analysis.receive_wait).

On columns (issue 58: compare of two 10^6-span traces spent ~4 s here one step at a time): every step's spans sorted
once by (step, rank, start), and each rule a pass of numpy over all of them. The floats are those of the
one-step-at-a-time rule it replaces (tests/traces/test_time_stats.py runs both on every trace it has): sums are
taken one after another in the same order (np.add.at adds in index order), and a running maximum within a group is
one np.maximum.accumulate over integer codes (group, rank of the value), not over shifted floats. A part's op is
found by start among its lane's top-level ops (the old rule bisected them in listing order: the same op wherever a
run lists a lane's ops in start order, an arbitrary one where it does not).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from traces.analysis.matching import key_groups, logical_stream
from traces.analysis.receive_wait import RECEIVE_KINDS, receive_wait
from traces.columns import Columns, columns_of
from traces.names import LOGICAL_STREAMS
from traces.trace import Trace

COMPUTE, HP, COMM = (LOGICAL_STREAMS.index(s) for s in ("compute", "hp", "comm"))


@dataclass
class TimeStats:
    """Makespan and per-rank time budget of one trace (schedule spans only); measured values are medians
    over steps."""
    makespan_us: float
    makespan_min_us: float
    makespan_max_us: float
    steps: int
    busy: dict[int, float]
    idle: dict[int, float]
    exposed_comm: dict[int, float]
    kind_time: dict[str, float]  # per kind, summed over ranks, per step (top-level compute + hp spans)
    rank_kind_time: dict[int, dict[str, float]] = field(default_factory=dict)  # the same per rank
    recv_wait: dict[int, float] = field(default_factory=dict)  # per rank and step: waiting for messages


def time_stats(trace: Trace) -> TimeStats:
    """Per step, then medians over the steps (module docstring)."""
    groups = key_groups(trace)
    ranks = sorted({key[0] for key in groups})  # a key's spans are its rank's (matching.span_key)
    rows, step = _by_step(groups)
    counts = np.bincount(step) if len(step) else np.zeros(0, np.int64)
    full = int(counts[0]) if len(counts) else 0
    counted = np.flatnonzero(counts >= 0.5 * full)  # a step counts when it is complete enough
    keep = np.isin(step, counted)
    rows, step = rows[keep], np.searchsorted(counted, step[keep]).astype(np.int32)  # renumbered 0..len(counted)-1
    del keep  # 10^7 spans: each array here is 40-80 MB, so none outlives its use
    n_steps = len(counted)
    cols = columns_of(trace)
    blocks = [_block(trace, cols, rows[a:b], step[a:b] - k0, k1 - k0, ranks) for a, b, k0, k1 in _blocks(step, n_steps)]
    mks = np.concatenate([b.makespan for b in blocks]) if blocks else np.zeros(0)
    R = len(ranks)
    busy = np.concatenate([b.busy for b in blocks]) if blocks else np.zeros((0, R))
    exposed = np.concatenate([b.exposed for b in blocks]) if blocks else np.zeros((0, R))
    idle = mks[:, None] - busy
    kind_time, rank_kind = _kind_medians([(b.touched, b.kind_steps) for b in blocks], cols.kinds, ranks, n_steps)
    waits: list[dict[int, float] | None] = [w for b in blocks for w in b.waits]

    def med(xs) -> float:
        return float(np.median(xs)) if len(xs) else 0.0

    return TimeStats(makespan_us=med(mks), makespan_min_us=float(mks.min()) if n_steps else 0.0,
                     makespan_max_us=float(mks.max()) if n_steps else 0.0, steps=n_steps,
                     busy={r: med(busy[:, j]) for j, r in enumerate(ranks)} if n_steps else {},
                     idle={r: med(idle[:, j]) for j, r in enumerate(ranks)} if n_steps else {},
                     exposed_comm={r: med(exposed[:, j]) for j, r in enumerate(ranks)} if n_steps else {},
                     kind_time=kind_time, rank_kind_time={r: rank_kind.get(r, {}) for r in ranks},
                     recv_wait=receive_wait(trace, ranks, waits))


BLOCK_ROWS = 1 << 20  # schedule spans per block of whole steps: the passes' temporaries stay ~100 MB at 10^7 spans


@dataclass
class _Block:
    """Per step of a block of whole steps: the makespan, each rank's busy and exposed time (step x rank), the time per
    touched (rank, kind) column (step x column; `touched`: rank index * kinds + kind code) and the timeline's
    receive waits (None each: the trace records WAIT spans)."""
    makespan: np.ndarray
    busy: np.ndarray
    exposed: np.ndarray
    touched: np.ndarray
    kind_steps: np.ndarray
    waits: list


def _blocks(step: np.ndarray, n_steps: int) -> list[tuple[int, int, int, int]]:
    """(first row, end row, first step, end step) of blocks of whole steps of about BLOCK_ROWS rows; `step` sorted.
    Every rule below works within a (step, rank), so a block's results are those the whole would give its steps."""
    bounds = np.searchsorted(step, np.arange(n_steps + 1))  # step k's rows: bounds[k]..bounds[k + 1]
    out, k0 = [], 0
    while k0 < n_steps:
        k1 = max(k0 + 1, int(np.searchsorted(bounds, bounds[k0] + BLOCK_ROWS, side="right")) - 1)
        k1 = min(k1, n_steps)
        out.append((int(bounds[k0]), int(bounds[k1]), k0, k1))
        k0 = k1
    return out


def _block(trace: Trace, cols: Columns, rows: np.ndarray, step: np.ndarray, n_steps: int, ranks: list[int]) -> _Block:
    """The per-step values of one block of whole steps (`step` numbered 0..n_steps-1 within it)."""
    start, dur = cols.start[rows], cols.duration[rows]
    end = start + dur
    rank = np.searchsorted(np.asarray(ranks, dtype=np.int64), cols.rank[rows]).astype(np.int32)  # index in `ranks`
    stream = _logical_streams(trace, cols, rows).astype(np.int8)
    first = np.r_[0, np.flatnonzero(np.diff(step)) + 1] if len(step) else np.zeros(0, np.int64)
    t0 = np.minimum.reduceat(start, first) if len(first) else np.zeros(0)
    mks = np.maximum.reduceat(end, first) - t0 if len(first) else np.zeros(0)
    R = len(ranks)
    group = step.astype(np.int64) * R + rank  # one group per (step, rank)
    on_compute = stream != COMM
    busy = _union_lengths(group[on_compute], start[on_compute], end[on_compute], n_steps * R)
    exposed = _union_lengths(group, start, end, n_steps * R) - busy
    touched, kind_steps = _kind_steps(cols, rows, step, rank, stream, start, dur, n_steps, R)
    if trace.meta.get("wait_spans"):  # receive waits from WAIT spans, not from the timeline
        waits: list[dict[int, float] | None] = [None] * n_steps
    else:
        waits = _timeline_waits(cols, rows, group, stream, start, end, t0, step, n_steps, ranks)
    return _Block(mks, busy.reshape(n_steps, R), exposed.reshape(n_steps, R), touched, kind_steps, waits)


def _by_step(groups: dict) -> tuple[np.ndarray, np.ndarray]:
    """The schedule spans grouped by step, in the order of their keys (the order the one-step rule listed them in,
    which decides ties below), and each one's step."""
    lens = np.fromiter(map(len, groups.values()), np.int64, len(groups))
    flat = np.concatenate(list(groups.values())) if groups else np.zeros(0, np.int64)
    inst = np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens)
    order = np.argsort(inst, kind="stable")
    return flat[order], inst[order].astype(np.int32)


def _logical_streams(trace: Trace, cols: Columns, rows: np.ndarray) -> np.ndarray:
    """Each row's logical stream as an index into LOGICAL_STREAMS: by its stream's code where the stream is one, by
    matching.logical_stream (which reads the span's name) where a reader put it on another ("cpu")."""
    table = np.array([LOGICAL_STREAMS.index(s) if s in LOGICAL_STREAMS else -1 for s in cols.streams], np.int64)
    out = table[cols.stream[rows]]
    other = np.flatnonzero(out < 0)
    if len(other):
        out[other] = [LOGICAL_STREAMS.index(logical_stream(s)) for s in trace.spans_at(rows[other])]
    return out


def _codes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct values, each value's index among them): integer stand-ins that order as the floats do."""
    return np.unique(values, return_inverse=True)


def _running_max(group: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per row, the largest value of its group up to and including it; rows sorted by group. Exact: the maximum of
    integer codes group * V + the value's rank, which order as (group, value) do."""
    if not len(values):
        return values
    distinct, code = _codes(values)
    key = group.astype(np.int64) * len(distinct) + code
    return distinct[np.maximum.accumulate(key) % len(distinct)]


def _union_lengths(group: np.ndarray, start: np.ndarray, end: np.ndarray, n_groups: int) -> np.ndarray:
    """Per group, the length the intervals cover (traces.trace.union_length): the merged stretches' lengths added
    in start order, as that loop adds them."""
    out = np.zeros(n_groups)
    if not len(group):
        return out
    order = np.lexsort((end, start, group))
    g, a = group[order], start[order]
    reach = _running_max(g, end[order])  # the end of the stretch reached so far
    new = np.ones(len(g), dtype=bool)
    new[1:] = (g[1:] != g[:-1]) | (a[1:] > reach[:-1])
    first = np.flatnonzero(new)
    last = np.r_[first[1:] - 1, len(g) - 1]
    np.add.at(out, g[first], reach[last] - a[first])
    return out


def _kind_steps(cols: Columns, rows, step, rank, stream, start, dur, n_steps: int,
                R: int) -> tuple[np.ndarray, np.ndarray]:
    """Per step and (rank, kind): the time of its top-level compute and hp spans, mHC kernel parts that run inside
    their op on the same stream (`F/s3/mb7/L12.pre` inside `F/s3/mb7`) carved out of the op and counted as their own
    kind. (the (rank, kind) columns a step touched as rank index * kinds + kind code, step x column times)."""
    kinds = cols.kinds
    part = np.array(["." in k for k in kinds], dtype=bool)
    in_pair = np.array([k.split(".", 1)[0] in ("F", "B") for k in kinds], dtype=bool)  # a stretch of a pair's half
    fb = np.array([k == "FB" for k in kinds], dtype=bool)
    sel = np.flatnonzero(stream != COMM)
    K = len(kinds)
    kind = cols.kind[rows[sel]].astype(np.int64)
    g = step[sel] * R + rank[sel]
    s_start, s_dur = start[sel], dur[sel]
    s_end = s_start + s_dur
    # top level: not nested in an earlier span of its rank (sorted by start, longest first, then listing order)
    order = np.lexsort((np.arange(len(sel)), -s_dur, s_start, g))
    og, oe = g[order], s_end[order]
    top_sorted = np.ones(len(order), dtype=bool)
    if len(order):
        reach = _running_max(og, oe)
        top_sorted[1:] = (og[1:] != og[:-1]) | (oe[1:] > reach[:-1])
    top = np.zeros(len(sel), dtype=bool)
    top[order[top_sorted]] = True
    # contributions (group, kind, +-duration) in the order the one-step rule adds them: the top-level spans in
    # sorted order, then each part inside a top-level op of its rank and stream, in listing order
    add_g = [og[top_sorted]]
    add_k = [kind[order[top_sorted]]]
    add_v = [s_dur[order[top_sorted]]]
    carve = _carved(g, stream[sel], kind, s_start, s_end, top, part, fb, in_pair)
    if carve is not None:
        j, host = carve
        add_g.append(np.repeat(g[j], 2))
        add_k.append(np.column_stack([kind[j], kind[host]]).ravel())
        add_v.append(np.column_stack([s_dur[j], -s_dur[j]]).ravel())
    ag, ak, av = np.concatenate(add_g), np.concatenate(add_k), np.concatenate(add_v)
    # one column per (rank, kind) a step touched (a profiler file's hundreds of kernel kinds never get one)
    touched, column = np.unique((ag % R) * K + ak, return_inverse=True)
    per_step = np.zeros((n_steps, len(touched)))
    np.add.at(per_step, (ag // R, column.ravel()), av)
    return touched, per_step


def _kind_medians(blocks: list[tuple[np.ndarray, np.ndarray]], kinds: tuple[str, ...], ranks: list[int],
                  n_steps: int) -> tuple[dict[str, float], dict[int, dict[str, float]]]:
    """Per (rank, kind) a block of steps touched: the median over all steps of its time (0 in a step that did not
    touch it); kind_time sums the ranks' medians in (rank, kind) order."""
    K = len(kinds)
    touched = np.unique(np.concatenate([t for t, _ in blocks])) if blocks else np.zeros(0, np.int64)
    per_step = np.zeros((n_steps, len(touched)))
    k0 = 0
    for t, steps in blocks:
        per_step[k0:k0 + len(steps), np.searchsorted(touched, t)] = steps
        k0 += len(steps)
    rank_kind: dict[int, dict[str, float]] = {}
    kind_time: dict[str, float] = {}
    # (rank, kind) in sorted order: kind_time's sums over ranks in one order whatever the process
    for q, rk in sorted(enumerate(touched.tolist()), key=lambda c: (ranks[c[1] // K], kinds[c[1] % K])):
        r, k = ranks[rk // K], kinds[rk % K]
        v = float(np.median(per_step[:, q]))
        rank_kind.setdefault(r, {})[k] = v
        kind_time[k] = kind_time.get(k, 0.0) + v
    return kind_time, rank_kind


def _carved(g, stream, kind, start, end, top, part, fb, in_pair) -> tuple[np.ndarray, np.ndarray] | None:
    """The kernel parts (not top level) inside a top-level op of their (step, rank, stream), and that op: of the
    lane's top-level spans, the last by (start, listing order) that starts at or before the part, when it is an op
    (not a part) and lasts to the part's end; a stretch of an overlapped F&B pair's half stays the pair's. None: no
    such part."""
    cand = np.flatnonzero(part[kind] & ~top)
    hosts = np.flatnonzero(top)
    if not len(cand) or not len(hosts):
        return None
    lane = g * len(LOGICAL_STREAMS) + stream  # (step, rank, stream)
    hosts = hosts[np.lexsort((hosts, start[hosts], lane[hosts]))]
    # (lane, start) as one integer per span, ordered as the pairs are: the last host at or before each part is one
    # search over all lanes
    distinct, code = _codes(np.r_[start[hosts], start[cand]])
    h_key = lane[hosts] * len(distinct) + code[:len(hosts)]
    c_key = lane[cand] * len(distinct) + code[len(hosts):]
    pos = np.searchsorted(h_key, c_key, side="right") - 1
    host = hosts[np.maximum(pos, 0)]
    ok = (pos >= 0) & (lane[host] == lane[cand])
    hk = kind[host]
    ok &= (end[host] >= end[cand]) & ~part[hk] & ~(fb[hk] & in_pair[kind[cand]])
    return cand[ok], host[ok]


def _timeline_waits(cols: Columns, rows, group, stream, start, end, t0, step, n_steps: int,
                    ranks: list[int]) -> list[dict[int, float]]:
    """Per step, per rank with compute: the idle stretches before its compute (from the step's start or its
    previous compute's end), each counted up to the last receive that completes inside it
    (traces.analysis.receive_wait)."""
    R = len(ranks)
    recv = np.array([k.split(".", 1)[0] in RECEIVE_KINDS for k in cols.kinds], dtype=bool)
    busy_rows = np.flatnonzero(stream != COMM)
    arr_rows = np.flatnonzero((stream == COMM) & recv[cols.kind[rows]])
    order = busy_rows[np.lexsort((end[busy_rows], start[busy_rows], group[busy_rows]))]
    g, a, b = group[order], start[order], end[order]
    reach = _running_max(g, b)
    prev = np.empty(len(g))
    if len(g):
        prev[0] = -np.inf
        prev[1:] = np.where(g[1:] == g[:-1], reach[:-1], -np.inf)
    free = np.maximum(t0[step[order]], prev)  # the step's start, or the end reached before
    q = a + 1e-9 * np.maximum(1.0, np.abs(a))
    # the last arrival of the group at or before q: arrivals and queries sorted together, arrivals first on ties
    ev_g = np.r_[group[arr_rows], g]
    ev_v = np.r_[end[arr_rows], q]
    ev_t = np.r_[np.zeros(len(arr_rows), np.int64), np.ones(len(g), np.int64)]
    ev = np.lexsort((ev_t, ev_v, ev_g))
    is_arr = ev_t[ev] == 0
    last = np.maximum.accumulate(np.where(is_arr, np.arange(len(ev)), -1)) if len(ev) else np.zeros(0, np.int64)
    at = np.empty(len(g), dtype=np.int64)
    at[ev[~is_arr] - len(arr_rows)] = last[~is_arr]
    found = at >= 0
    src = ev[np.maximum(at, 0)]
    found &= ev_g[src] == g
    arrival = ev_v[src]
    waited = found & (a > free) & (arrival > free)
    out = np.zeros(n_steps * R)
    np.add.at(out, g[waited], np.minimum(arrival[waited], a[waited]) - free[waited])
    has = np.zeros(n_steps * R, dtype=bool)
    has[g] = True
    per_step = out.reshape(n_steps, R)
    has = has.reshape(n_steps, R)
    return [{ranks[j]: float(per_step[k, j]) for j in np.flatnonzero(has[k]).tolist()} for k in range(n_steps)]
