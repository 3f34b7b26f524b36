"""Which spans of two traces are the same action, and which step of a run to compare (costmodel.md §4, traces.md
§5). Schedule spans (an op kind of traces.md §5 with a stage; mHC kernel parts like `F/s3/mb7/L12.post_res` count as
kind `F.post_res`) are keyed on (rank, kind, stage, micro-batch, FB partner, part); a measured trace with several
steps holds each key once per step, in step order. Two traces describe the same schedule when their metadata
agree and enough keys are shared.
"""
from __future__ import annotations

import numpy as np

from traces.names import ALL_COMM_KINDS, LOGICAL_STREAMS, is_schedule_span, kernel_part, parse_name
from traces.columns import columns_of, keep_columns
from traces.analysis.stage_chains import schedule_descriptor
from traces.analysis.step_keys import GIVEN, cut_key_ids, keep_step_arrays, key_groups_of, step_arrays
from traces.trace import Span, Trace, TraceError, has_kept, kept

Key = tuple[int, str, int | None, int | None, tuple[int, int] | None, str | None]
MIN_SHARED_KEYS = 0.5  # below this fraction of shared keys the two traces are different schedules


def span_key(s: Span) -> Key:
    return (s.rank, s.kind, s.stage, s.mb, s.partner, kernel_part(s.label) if "." in s.kind else None)


def key_label(k: Key) -> str:
    rank, kind, stage, mb, partner, part = k
    name = f"{kind.split('.', 1)[0]}/s{stage}/mb{mb}"
    if partner is not None:
        name += f"+s{partner[0]}/mb{partner[1]}"
    if part is not None:
        name += f"/{part}"
    return f"rank {rank} {name}"


def logical_stream(s: Span) -> str:
    """compute / hp / comm for a schedule span, whatever stream the reader put it on (e.g. "cpu")."""
    if s.stream in LOGICAL_STREAMS:
        return s.stream
    parsed = parse_name(s.label)
    if parsed is not None and parsed.stream in LOGICAL_STREAMS:
        if parsed.stream != "compute" or s.kind.split(".", 1)[0] not in ALL_COMM_KINDS:
            return parsed.stream
    return "comm" if s.kind.split(".", 1)[0] in ALL_COMM_KINDS else "compute"


def schedule_spans(trace: Trace) -> np.ndarray:
    """Indices (int64, ascending) of the spans that take part in matching (a schedule op kind with a stage)."""
    return kept(trace, "_schedule_spans", lambda: _schedule_spans(trace))


def _schedule_spans(trace: Trace) -> np.ndarray:
    cols = columns_of(trace)  # the kinds on the columns, the stage read only where they are
    cand = np.flatnonzero(np.array([is_schedule_span(k, 0) for k in cols.kinds], dtype=bool)[cols.kind])
    return cand[trace.known("stage", cand)]


def key_groups(trace: Trace) -> dict[Key, np.ndarray]:
    """Key -> its spans' indices (an int64 array) in start order (kept on the trace: traces.trace.kept)."""
    return kept(trace, "_key_groups", lambda: _key_groups(trace))


def _key_groups(trace: Trace) -> dict[Key, np.ndarray]:
    return key_groups_of(trace, span_key)  # grouped on integer key ids: no key tuple per span


def match_spans(pred: Trace, meas: Trace) -> list[tuple[int, int]]:
    """(pred index, meas index) pairs. One predicted instance pairs with every measured instance (steps)."""
    pp, mm = matched_indices(pred, meas)
    return list(zip(pp.tolist(), mm.tolist()))


def matched_indices(pred: Trace, meas: Trace) -> tuple[np.ndarray, np.ndarray]:
    """match_spans' pairs as two index arrays, in its order: per predicted key (key_groups' order), a lone
    predicted instance with every measured one, else instance k with instance k (a long run's 10^6 pairs without a
    tuple each)."""
    pg, mg = key_groups(pred), key_groups(meas)
    ps: list[np.ndarray] = []
    ms: list[np.ndarray] = []
    for key, pidx in pg.items():
        midx = mg.get(key)
        if midx is None or not len(midx):
            continue
        if len(pidx) == 1:
            ps.append(np.full(len(midx), pidx[0], dtype=np.int64))
            ms.append(np.asarray(midx, dtype=np.int64))
        else:
            n = min(len(pidx), len(midx))
            ps.append(np.asarray(pidx[:n], dtype=np.int64))
            ms.append(np.asarray(midx[:n], dtype=np.int64))
    if not ps:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(ps), np.concatenate(ms)


def step_index(trace: Trace) -> dict[int, int]:
    """Span index -> step (instance order of its key), for schedule spans (kept on the trace: traces.trace.kept);
    in ascending index order where the trace's step arrays were given (the warm-up drop's, a .npz file's:
    traces.analysis.step_keys.keep_step_arrays), else in key_groups' order, whatever else was asked of the trace
    before (the order callers that sum per step, such as costmodel.local.runtime_fit, add in). The analyses of long
    runs use the arrays themselves."""
    def make() -> dict[int, int]:
        if has_kept(trace, GIVEN):
            rows, steps = step_arrays(trace)
            return dict(zip(rows.tolist(), steps.tolist()))
        return {i: k for idx in key_groups(trace).values() for k, i in enumerate(idx.tolist())}
    return kept(trace, "_step_index", make)


def drop_warmup_step(trace: Trace) -> Trace:
    """The trace without its first step (warm-up: allocator, first-touch pages), when it has more than one step:
    the first step's schedule spans and, on each rank, every other span (WAIT, step and optimizer ranges) that
    starts before the rank's first schedule span of the next step. A trace cut from a run after its warm-up
    (`mhcpipe convert --steps`: meta first_step >= 1) has none to drop."""
    if int(trace.meta.get("first_step", 0) or 0) >= 1:
        return trace
    sched, sched_k = step_arrays(trace)
    if not len(sched_k) or sched_k.max() < 1:
        return trace
    cols = columns_of(trace)  # on columns: a long run's trace holds 10^6 spans
    step = np.full(len(cols), -1, dtype=np.int32)
    step[sched] = sched_k
    drop = step == 0
    second = np.flatnonzero(step == 1)  # each rank's first schedule span of the next step bounds its other spans
    next_start = np.full(int(cols.rank.max()) + 1, np.inf)
    np.minimum.at(next_start, cols.rank[second], cols.start[second])
    next_start[np.isinf(next_start)] = -np.inf  # a rank without a next step keeps its other spans
    drop |= (step < 0) & (cols.start < next_start[cols.rank])
    remain = np.flatnonzero(~drop)
    out = trace.subset(remain, dict(trace.meta))
    # every key lost its first instance and kept the rest in order: a kept span's step is one less
    kept_sched = np.flatnonzero(step[remain] >= 0).astype(np.int32)
    keep_step_arrays(out, kept_sched, step[remain[kept_sched]] - 1)
    keep_columns(out, trace, remain)
    cut_key_ids(trace, out, remain)
    return out


# ---- schedule identity -------------------------------------------------------------------------------------

def check_same_schedule(pred: Trace, meas: Trace, pred_name: str = "PRED", meas_name: str = "MEAS") -> None:
    ps, ms = pred.meta.get("source"), meas.meta.get("source")
    if ps == "measured" and ms in ("predicted", "simulated"):
        raise TraceError(f"{pred_name} is a measured trace and {meas_name} a {ms} one: the arguments are swapped "
                         "(pass the prediction first, then the measurement)")
    pd, md = schedule_descriptor(pred.meta), schedule_descriptor(meas.meta)
    diffs = [f"{k} {pd[k]!r} vs {md[k]!r}" for k in pd if k in md and str(pd[k]).lower() != str(md[k]).lower()]
    if diffs:
        raise TraceError(f"{pred_name} and {meas_name} are traces of different schedules ({'; '.join(diffs)}); "
                         "compare a measured run with the prediction of the same schedule")
    pk, mk = set(key_groups(pred)), set(key_groups(meas))
    for keys, name, t in ((pk, pred_name, pred), (mk, meas_name, meas)):
        if not keys:
            foreign = t.meta.get("foreign_ranges") or {}
            hint = f"; it holds {len(t.spans)} spans, e.g. ranges {list(foreign)[:3]}" if t.spans else ""
            raise TraceError(f"{name} has no schedule spans named as in traces.md §5 (e.g. F/s3/mb7){hint}; "
                             "label ranges with the naming convention (NVTX or record_function)")
    shared = len(pk & mk)
    if shared < MIN_SHARED_KEYS * max(len(pk), len(mk)):
        examples = [f"only in {name}: {', '.join(key_label(k) for k in sorted(keys, key=str)[:2])}"
                    for name, keys in ((pred_name, pk - mk), (meas_name, mk - pk)) if keys]
        raise TraceError(f"{pred_name} and {meas_name} are traces of different schedules: only {shared} of "
                         f"{len(pk)} predicted and {len(mk)} measured ops share (rank, kind, stage, micro-batch) "
                         f"(e.g. {'; '.join(examples)}); compare a run with the prediction of the same schedule")


# ---- statistics --------------------------------------------------------------------------------------------
