"""Predicted vs measured: match spans 1:1 and report the errors (costmodel.md §4, traces.md §5).

Matching: schedule spans (an op kind of traces.md §5 with a stage; mHC kernel parts like `F/s3/mb7/L12.post_res`
count as kind `F.post_res`) are joined on (rank, kind, stage, micro-batch, FB partner, part). When the measured
trace holds several steps (each key k times, the prediction once), every measured instance is compared with the
prediction and the instance order (by start) is the step index. Unmatched spans on either side are listed.

Per op e = (pred - meas) / meas: signed median, median |e| and p90 |e| per kind with counts, for the ops whose
spans mean the same on both sides. SEND/RECV spans do not when one trace is a prediction and the other a run
(traces.analysis.receive_wait.comm_span_meaning): the predicted span is the transfer (both sides posted -> arrival), the
measured one the op from its post to its completion, which also holds the wait for the peer. Those are listed
apart with their means (`comm_spans`), not as errors; the communication the two sides can compare is the time
a rank's compute waits for incoming messages, per rank (traces.analysis.receive_wait). Makespan: end of the last minus
start of the first schedule span of a step (median over measured steps, with min/max as the run-to-run
spread); relative error in %. Per rank: busy (union of compute + hp spans), idle = makespan - busy, bubble
fraction, waiting for messages. Overhead (with a baseline pair): T_mHC / T_base - 1, predicted and measured
each from their own baseline, difference in percentage points.

Clocks: spans of different ranks are compared on their trace's time axis, which assumes one clock per trace
(one host, or nsys/Kineto files aligned by the reader).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Hashable

import numpy as np

from traces.analysis.comm_overlap import comm_overlap
from traces.names import ALL_COMM_KINDS
from traces.analysis.path_overhead import compare_paths
from traces.analysis.receive_wait import comm_span_meaning
from traces.analysis.time_stats import TimeStats, time_stats
from traces.columns import columns_of
from traces.trace import Trace, TraceError
from traces.analysis.matching import (check_same_schedule, key_label, logical_stream, matched_indices,
                             schedule_spans, span_key)

@dataclass
class KindError:
    kind: str
    n: int
    signed_median_pct: float
    median_abs_pct: float
    p90_abs_pct: float
    pred_mean_us: float
    meas_mean_us: float


@dataclass
class RankStats:
    rank: int
    pred_busy_us: float
    meas_busy_us: float
    pred_idle_us: float
    meas_idle_us: float
    pred_bubble_pct: float
    meas_bubble_pct: float
    bubble_diff_pp: float
    # the time per step the rank's compute waited for incoming messages (traces.analysis.receive_wait)
    pred_recv_wait_us: float
    meas_recv_wait_us: float
    # from the measured trace's WAIT spans (traces.analysis.comm_overlap), None when it has none: per step, the time the
    # compute thread blocked on communication, and the share of communication time hidden under compute
    meas_comm_wait_us: float | None = None
    comm_hidden_pct: float | None = None
    fb_comm_hidden_pct: float | None = None  # the ops posted inside overlapped F&B pairs


@dataclass
class CommSpans:
    """One communication kind whose spans mean different things in the two traces: their means, side by side."""
    kind: str
    n: int
    pred_mean_us: float  # over the predicted spans (what comm_span_meaning['pred'] says they cover)
    meas_mean_us: float  # over the matched measured spans (comm_span_meaning['meas'])


@dataclass
class Overhead:
    pred_pct: float
    meas_pct: float
    diff_pp: float
    base_pred_makespan_us: float
    base_meas_makespan_us: float
    mhc_pred_makespan_us: float
    mhc_meas_makespan_us: float
    breakdown_pred_pp: dict[str, float]
    breakdown_meas_pp: dict[str, float]


@dataclass
class Comparison:
    pred: dict[str, Any]
    meas: dict[str, Any]
    matched: int
    steps: int
    unmatched_pred: list[str]
    unmatched_meas: list[str]
    kinds: list[KindError]
    makespan_pred_us: float
    makespan_meas_us: float
    makespan_meas_min_us: float
    makespan_meas_max_us: float
    makespan_err_pct: float
    ranks: list[RankStats]
    overhead: Overhead | None = None
    notes: list[str] = field(default_factory=list)
    comm_span_meaning: dict[str, str] = field(default_factory=dict)  # "pred" / "meas": what a SEND/RECV span covers
    comm_spans: list[CommSpans] = field(default_factory=list)  # SEND/RECV kinds kept out of `kinds` (unlike spans)
    # the critical path of a step, predicted ("pred") and measured ("meas"), and with a baseline pair mHC's
    # overhead along them ("overhead_on_path"): traces.analysis.path_overhead.compare_paths
    critical_path: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pct(x: float) -> float:
    return float(100.0 * x)


def _rank_rows(ps: TimeStats, ms: TimeStats, overlap) -> list[RankStats]:
    """Per rank: busy, idle and bubble predicted and measured, receive waits, and (from the measured trace's
    comm overlap, when it has comm spans) the exposed comm wait per step and the share of comm hidden."""
    ranks = []
    for r in sorted(set(ps.busy) | set(ms.busy)):
        pb, mb = ps.busy.get(r, 0.0), ms.busy.get(r, 0.0)
        pi, mi = ps.idle.get(r, ps.makespan_us), ms.idle.get(r, ms.makespan_us)
        pbf = _pct(pi / ps.makespan_us) if ps.makespan_us else 0.0
        mbf = _pct(mi / ms.makespan_us) if ms.makespan_us else 0.0
        row = RankStats(rank=r, pred_busy_us=pb, meas_busy_us=mb, pred_idle_us=pi, meas_idle_us=mi,
                        pred_bubble_pct=pbf, meas_bubble_pct=mbf, bubble_diff_pp=pbf - mbf,
                        pred_recv_wait_us=ps.recv_wait.get(r, 0.0), meas_recv_wait_us=ms.recv_wait.get(r, 0.0))
        o = None if overlap is None else overlap.get(r)
        if o is not None:
            row.meas_comm_wait_us = o.blocked_us / max(1, ms.steps)
            row.comm_hidden_pct = o.all.hidden_pct
            row.fb_comm_hidden_pct = o.in_fb.hidden_pct
        ranks.append(row)
    return ranks


def compare(pred: Trace, meas: Trace, baseline: tuple[Trace, Trace] | None = None,
            names: tuple[str, str] = ("PRED", "MEAS"), critical: bool = True) -> Comparison:
    """Compare a predicted with a measured trace of the same schedule; with `baseline=(base_pred,
    base_meas)` also the measured vs predicted mHC overhead; `critical`: also both critical paths."""
    check_same_schedule(pred, meas, *names)
    # the matched pairs as index arrays and masks, per kind in pair order (10^6 spans: no tuple, set or float
    # object per pair)
    pp, mm = matched_indices(pred, meas)
    matched_p = np.zeros(pred.span_count, dtype=bool)
    matched_p[pp] = True
    matched_m = np.zeros(meas.span_count, dtype=bool)
    matched_m[mm] = True
    pc, mc = columns_of(pred), columns_of(meas)
    pd_all, md_all = pc.duration[pp], mc.duration[mm]
    kind_of_pair = np.asarray(pc.kinds, dtype=object)[pc.kind[pp]] if len(pp) else np.empty(0, dtype=object)
    errs: dict[str, np.ndarray] = {}
    pdur: dict[str, np.ndarray] = {}
    mdur: dict[str, np.ndarray] = {}
    for kind in dict.fromkeys(kind_of_pair.tolist()):  # kinds in order of first pair, as a loop would add them
        sel = kind_of_pair == kind
        pdur[kind], mdur[kind] = pd_all[sel], md_all[sel]
        pos = mdur[kind] > 0
        errs[kind] = (pdur[kind][pos] - mdur[kind][pos]) / mdur[kind][pos]
    zero_meas = int(np.count_nonzero(~(md_all > 0)))
    meaning = {"pred": comm_span_meaning(pred), "meas": comm_span_meaning(meas)}
    unlike = meaning["pred"] != meaning["meas"]
    kinds, comm_spans = [], []
    for kind in sorted(pdur, key=_kind_order):
        if unlike and kind.split(".", 1)[0] in ALL_COMM_KINDS:
            comm_spans.append(CommSpans(kind=kind, n=len(pdur[kind]), pred_mean_us=float(np.mean(pdur[kind])),
                                        meas_mean_us=float(np.mean(mdur[kind]))))
            continue
        e = np.asarray(errs[kind])
        # a kind whose measured spans all have zero length (e.g. free simulated P2P) has no relative error
        stats = (np.median(e), np.median(np.abs(e)), np.percentile(np.abs(e), 90)) if e.size else (np.nan,) * 3
        kinds.append(KindError(kind=kind, n=len(errs[kind]), signed_median_pct=_pct(stats[0]),
                               median_abs_pct=_pct(stats[1]), p90_abs_pct=_pct(stats[2]),
                               pred_mean_us=float(np.mean(pdur[kind])), meas_mean_us=float(np.mean(mdur[kind]))))
    fb_halves = _fb_halves(meas, matched_m)
    fb_halves = fb_halves[~matched_m[fb_halves]]
    unpriced_parts = _unpriced_parts(pred, meas, matched_m)
    sp, sm = schedule_spans(pred), schedule_spans(meas)
    unmatched_p = [key_label(span_key(s)) for s in pred.spans_at(sp[~matched_p[sp]])]
    covered = matched_m.copy()  # matched, or an F&B pair's half, or a part the prediction does not price
    covered[fb_halves] = True
    covered[unpriced_parts] = True
    unmatched_m = [key_label(span_key(s)) for s in meas.spans_at(sm[~covered[sm]])]
    ps, ms = time_stats(pred), time_stats(meas)
    ranks = _rank_rows(ps, ms, comm_overlap(meas))
    notes = []
    if comm_spans:
        notes.append(f"SEND/RECV spans cover the {meaning['pred']} in the prediction and the {meaning['meas']} in the "
                     "measurement: listed apart, not compared per op; waiting for messages is compared per rank")
    if zero_meas:
        notes.append(f"{zero_meas} matched measured spans have zero duration and are left out of the error statistics")
    if len(fb_halves):
        notes.append(f"{len(fb_halves)} measured F/B child ranges of overlapped FB pairs are covered by their FB span")
    if len(unpriced_parts):
        mc = columns_of(meas)
        part_kinds = sorted({mc.kinds[k] for k in np.unique(mc.kind[unpriced_parts]).tolist()})
        notes.append(f"{len(unpriced_parts)} measured kernel parts ({', '.join(part_kinds)}) are inside their actions: "
                     "the prediction prices whole actions, not parts")
    units = {label: t.meta.get("time_unit", "us") for label, t in (("predicted", pred), ("measured", meas))}
    if len(set(units.values())) > 1:
        notes.append(f"time units differ (predicted in {units['predicted']!r}, measured in {units['measured']!r}): "
                     "per-op errors and the makespan error compare unlike units; predict in microseconds")
    for label, t in (("measured", meas), ("predicted", pred)):
        if t.meta.get("rank_assumed"):
            notes.append(f"the {label} trace has no rank information; rank 0 was assumed")
        if str(t.meta.get("projection", "")).startswith("none") and label == "measured":
            notes.append(f"measured spans are not GPU-projected ({t.meta['projection']})")
    comp = Comparison(
        pred=_describe(pred), meas=_describe(meas), matched=len(pp), steps=ms.steps,
        unmatched_pred=unmatched_p, unmatched_meas=unmatched_m, kinds=kinds,
        makespan_pred_us=ps.makespan_us, makespan_meas_us=ms.makespan_us, makespan_meas_min_us=ms.makespan_min_us,
        makespan_meas_max_us=ms.makespan_max_us,
        makespan_err_pct=_pct((ps.makespan_us - ms.makespan_us) / ms.makespan_us) if ms.makespan_us else float("nan"),
        ranks=ranks, notes=notes, comm_span_meaning=meaning, comm_spans=comm_spans)
    if baseline is not None:
        comp.overhead = overhead(baseline[0], baseline[1], pred, meas, ps, ms)
    if critical:
        comp.critical_path, path_notes = compare_paths(pred, meas, baseline)
        comp.notes.extend(path_notes)
    return comp


def overhead(base_pred: Trace, base_meas: Trace, mhc_pred: Trace, mhc_meas: Trace,
             mhc_ps: TimeStats | None = None, mhc_ms: TimeStats | None = None) -> Overhead:
    """overhead = T_mHC / T_base - 1 for prediction and measurement; breakdown per kind in percentage points of
    the baseline makespan (added time per kind summed over ranks / (ranks x T_base)), plus idle."""
    check_same_schedule(base_pred, base_meas, "--baseline-pred", "--baseline-meas")
    bp, bm = time_stats(base_pred), time_stats(base_meas)
    mp, mm = mhc_ps or time_stats(mhc_pred), mhc_ms or time_stats(mhc_meas)
    for name, st in (("--baseline-pred", bp), ("--baseline-meas", bm)):
        if st.makespan_us <= 0:
            raise TraceError(f"{name}: the baseline trace has zero makespan; cannot compute an overhead")
    op = mp.makespan_us / bp.makespan_us - 1
    om = mm.makespan_us / bm.makespan_us - 1
    return Overhead(pred_pct=_pct(op), meas_pct=_pct(om), diff_pp=_pct(op - om),
                    base_pred_makespan_us=bp.makespan_us, base_meas_makespan_us=bm.makespan_us,
                    mhc_pred_makespan_us=mp.makespan_us, mhc_meas_makespan_us=mm.makespan_us,
                    breakdown_pred_pp=_breakdown(bp, mp), breakdown_meas_pp=_breakdown(bm, mm))


def _breakdown(base: TimeStats, mhc: TimeStats) -> dict[str, float]:
    nranks = max(len(base.busy), 1)
    denom = nranks * base.makespan_us
    out = {}
    for kind in sorted(set(base.kind_time) | set(mhc.kind_time), key=_kind_order):
        out[kind] = _pct((mhc.kind_time.get(kind, 0.0) - base.kind_time.get(kind, 0.0)) / denom)
    out["idle"] = _pct((sum(mhc.idle.values()) - sum(base.idle.values())) / denom)
    return out


def _unpriced_parts(pred: Trace, meas: Trace, matched: np.ndarray) -> np.ndarray:
    """Measured kernel parts (kind "F.post_res", ...) when the prediction has no parts at all (it priced whole
    actions, e.g. the `local` runtime profile): inside their actions, not missing from the schedule. `matched`:
    a mask over meas's spans."""
    pc, mc = columns_of(pred), columns_of(meas)
    if np.array(["." in k for k in pc.kinds], dtype=bool)[pc.kind[schedule_spans(pred)]].any():
        return np.zeros(0, dtype=np.int64)
    sched = schedule_spans(meas)
    part = np.array(["." in k for k in mc.kinds], dtype=bool)[mc.kind[sched]]
    return sched[part & ~matched[sched]]


def _fb_halves(meas: Trace, matched: np.ndarray) -> np.ndarray:
    """Measured F/B spans (ascending indices) that are the children of a matched FB span on the same rank: the
    whole halves of a pair run one after the other, or the stretches (`F/s3/mb7/L12.block`) of an overlapped pair's
    halves. `matched`: a mask over meas's spans."""
    cols = columns_of(meas)
    fb = [k for k, name in enumerate(cols.kinds) if name == "FB"]
    pairs = np.flatnonzero(matched & np.isin(cols.kind, fb))
    pairs = pairs[meas.known("partner", pairs)]
    none = np.zeros(0, dtype=np.int64)
    if not len(pairs):
        return none
    half_kind = np.array([name.split(".", 1)[0] in ("F", "B") for name in cols.kinds], dtype=bool)
    cand = np.flatnonzero(half_kind[cols.kind])  # the F and B spans and their parts, by kind code
    cand = cand[meas.known("stage", cand)]  # schedule spans only
    # (rank, half, stage, mb) as one integer (-1 for an unknown stage or micro-batch, as None matches None)
    partner = np.asarray(meas.field("partner", pairs), dtype=np.int64).reshape(-1, 2)
    rank = cols.rank[pairs].astype(np.int64)
    h_rank = np.r_[rank, rank]
    h_half = np.r_[np.zeros(len(pairs), np.int64), np.ones(len(pairs), np.int64)]
    h_stage = np.r_[meas.ints("stage", pairs), partner[:, 0]]
    h_mb = np.r_[meas.ints("mb", pairs), partner[:, 1]]
    c_half = np.array([name.split(".", 1)[0] == "B" for name in cols.kinds], dtype=np.int64)[cols.kind[cand]]
    c_stage, c_mb = meas.ints("stage", cand), meas.ints("mb", cand)
    S = int(max(h_stage.max(), c_stage.max(initial=-1))) + 2
    M = int(max(h_mb.max(), c_mb.max(initial=-1))) + 2

    def key(r, half, stage, mb):
        return ((r * 2 + half) * S + stage + 1) * M + mb + 1

    c_rank = cols.rank[cand].astype(np.int64)
    hit = cand[np.isin(key(c_rank, c_half, c_stage, c_mb), key(h_rank, h_half, h_stage, h_mb))]
    is_part = np.array(["." in name for name in cols.kinds], dtype=bool)[cols.kind[hit]]
    parts = hit[is_part]  # a part counts when it runs on the compute stream
    on_compute = np.fromiter((logical_stream(s) == "compute" for s in meas.spans_at(parts)), bool, len(parts))
    return np.sort(np.r_[hit[~is_part], parts[on_compute]])


_ORDER = {k: i for i, k in enumerate(("F", "I", "B", "W", "FB", "RC", "RG", "SEND_F", "RECV_F", "SEND_B", "RECV_B",
                                      "OPT"))}


def _kind_order(kind: Hashable) -> tuple[int, str]:
    k = str(kind)
    return (_ORDER.get(k.split(".", 1)[0], 99) * 2 + ("." in k), k)


def _describe(t: Trace) -> dict[str, Any]:
    keep = ("source", "format", "file", "schedule", "schema_version", "projection")
    return {k: t.meta[k] for k in keep if k in t.meta} | {"spans": t.span_count,
                                                            "ranks": len(np.unique(columns_of(t).rank))}
