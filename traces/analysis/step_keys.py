"""Which step and which key each schedule span has, as integer arrays (issue 58: 10^7 spans without a key tuple or a
dict entry per span, ~0.8 GB less than `matching.step_index`'s dict at that size).

A schedule span's key is `matching.span_key`'s (rank, kind, stage, micro-batch, FB partner, kernel part) written as
integer columns, then one int32 id per span (`key_ids`: equal ids, equal keys); its step is its instance number
among its key's spans in (start, index) order, as `matching.key_groups` sorts them (`key_groups_of` groups on the
ids). Two front ends, one rule (`keyed_steps`): from a trace's spans (`step_arrays`, `key_ids`, kept on the trace),
and from a .npz file's columns before any span exists (`file_key_ids`, `file_step_index`; traces.formats.npz), the
ids then kept on the trace read, its warm-up drop and its step cuts.
"""
from __future__ import annotations

from operator import attrgetter
from typing import Callable, Hashable

import numpy as np

from traces.columns import columns_of
from traces.formats.npz import ColumnFile
from traces.names import is_schedule_span, kernel_part
from traces.trace import Span, Trace, has_kept, keep, kept, span_name


def keyed_steps(rows: np.ndarray, keys: tuple[np.ndarray, ...], start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows in ascending order, each one's step): `keys` are the rows' key columns (primary last), `start` their
    starts; a key's instances are numbered in (start, row) order."""
    n = len(rows)
    order = np.lexsort((rows, start) + keys)
    new = np.zeros(n, dtype=bool)  # where a key's instances begin in that order
    new[:1] = True
    for k in keys:
        ks = k[order]
        new[1:] |= ks[1:] != ks[:-1]
    first = np.maximum.accumulate(np.where(new, np.arange(n), 0))
    steps = np.empty(n, dtype=np.int32)
    steps[order] = np.arange(n) - first
    return rows.astype(np.int32), steps


class _Parts:
    """Integer codes of kernel parts (-1: none), each label parsed once."""

    def __init__(self) -> None:
        self.codes: dict[str | None, int] = {None: -1}
        self.by_label: dict[str, int] = {}

    def code(self, label: str) -> int:
        c = self.by_label.get(label)
        if c is None:
            c = self.by_label[label] = self.codes.setdefault(kernel_part(label), len(self.codes) - 1)
        return c


def _dotted(kinds: list[str], kind: np.ndarray) -> np.ndarray:
    """The rows whose kind names a kernel part (`F.post_res`): only theirs has a part in the key."""
    return np.flatnonzero(np.array(["." in k for k in kinds], dtype=bool)[kind])


def step_arrays(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """(schedule span indices ascending, their steps) of `trace` (kept on it: traces.trace.kept), numbered on its
    key ids (key_ids, which matching.key_groups groups on too: one pass over the spans for both)."""
    return kept(trace, "_step_arrays", lambda: _from_spans(trace))


def keep_step_arrays(trace: Trace, rows: np.ndarray, steps: np.ndarray) -> None:
    """`trace`'s step arrays, known already (a .npz file's, or the warm-up drop's of the trace it cuts)."""
    keep(trace, "_step_arrays", (rows, steps))
    keep(trace, GIVEN, True)


GIVEN = "_step_arrays_given"  # kept beside them: matching.step_index lists such a trace's spans in index order


def _from_spans(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    rows, ids = key_ids(trace)
    return keyed_steps(rows, (ids,), columns_of(trace).start[rows])


def key_groups_of(trace: Trace, key_of: Callable[[Span], Hashable]) -> dict[Hashable, np.ndarray]:
    """matching.key_groups' dict: key -> its spans' indices (an int64 array) in (start, index) order, the keys in
    the order of their first span. The spans are grouped on their key ids (one lexsort), and `key_of`
    (matching.span_key) is asked once per key, of its first span: 10^6 spans, ~600 keys."""
    rows, ids = key_ids(trace)
    n = len(rows)
    if not n:
        return {}
    order = np.lexsort((rows, columns_of(trace).start[rows], ids))
    members = rows[order].astype(np.int64)
    grouped = ids[order]
    bounds = np.r_[0, np.flatnonzero(grouped[1:] != grouped[:-1]) + 1, n]
    first = np.minimum.reduceat(members, bounds[:-1])  # where each key first appears
    groups = np.argsort(first, kind="stable")
    return {key_of(s): members[bounds[g]:bounds[g + 1]] for s, g in zip(trace.spans_at(first[groups]), groups.tolist())}


KEY_IDS = "_key_ids"


def key_ids(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """(the schedule spans' indices ascending, each one's key as an integer id: equal ids, equal
    matching.span_key), kept on the trace: from a .npz file's columns where it was read so (keep_key_ids), else from
    the spans."""
    def make() -> tuple[np.ndarray, np.ndarray]:
        rows, keys, _ = _span_keys(trace)
        return rows.astype(np.int32), _ids(keys)
    return kept(trace, KEY_IDS, make)


def keep_key_ids(trace: Trace, rows: np.ndarray, ids: np.ndarray) -> None:
    keep(trace, KEY_IDS, (rows, ids))


def cut_key_ids(whole: Trace, cut: Trace, kept_rows: np.ndarray) -> None:
    """`cut` holds the spans `kept_rows` (ascending) of `whole`: where whole's key ids are known, cut's are theirs
    (a 10^7-span run's warm-up drop needs no pass over its spans for them)."""
    if has_kept(whole, KEY_IDS):
        keep_key_ids(cut, *cut_ids(*key_ids(whole), kept_rows))


def cut_ids(rows: np.ndarray, ids: np.ndarray, kept_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The key ids of the spans `kept_rows` (ascending), indexed as the cut holds them."""
    inside = np.isin(rows, kept_rows)
    return np.searchsorted(kept_rows, rows[inside]).astype(np.int32), ids[inside]


def _ids(keys: tuple[np.ndarray, ...]) -> np.ndarray:
    """One int32 per row, equal where every key column is."""
    n = len(keys[0]) if keys else 0
    order = np.lexsort(keys)
    new = np.zeros(n, dtype=bool)
    new[:1] = True
    for k in keys:
        ks = k[order]
        new[1:] |= ks[1:] != ks[:-1]
    ids = np.empty(n, dtype=np.int32)
    ids[order] = np.cumsum(new) - 1
    return ids


def _span_keys(trace: Trace) -> tuple[np.ndarray, tuple[np.ndarray, ...], np.ndarray]:
    """(the schedule spans' indices ascending, their key columns as keyed_steps takes them, their starts)."""
    cols, spans = columns_of(trace), trace.spans
    sched_kind = np.array([is_schedule_span(k, 0) for k in cols.kinds], dtype=bool)
    cand = np.flatnonzero(sched_kind[cols.kind])
    picked = list(map(spans.__getitem__, cand.tolist()))
    stage = np.array([-1 if s is None else s for s in map(attrgetter("stage"), picked)], dtype=np.int64)
    has = stage >= 0
    rows = cand[has]
    picked = [s for s, h in zip(picked, has.tolist()) if h]
    mb = np.array([-1 if m is None else m for m in map(attrgetter("mb"), picked)], dtype=np.int64)
    partners = list(map(attrgetter("partner"), picked))
    has_partner = np.array([p is not None for p in partners], dtype=bool)
    pp = np.zeros((len(picked), 2), dtype=np.int64)
    paired = np.flatnonzero(has_partner)  # F&B pairs only: no tuple made for the other spans
    if len(paired):
        pp[paired] = [partners[j] for j in paired.tolist()]
    kind = cols.kind[rows]
    part, parts = np.full(len(rows), -1, dtype=np.int32), _Parts()
    dotted = _dotted(list(cols.kinds), kind)
    part[dotted] = [parts.code(picked[j].label) for j in dotted.tolist()]
    keys = (part, pp[:, 1], pp[:, 0], has_partner, mb, stage[has], kind, cols.rank[rows])
    return rows, keys, cols.start[rows]


def file_step_index(cf: ColumnFile) -> tuple[np.ndarray, np.ndarray]:
    """step_arrays of a .npz trace, on its columns: no Span object made."""
    rows, ids = file_key_ids(cf)
    return keyed_steps(rows, (ids,), cf.cols["start"][rows])


def file_key_ids(cf: ColumnFile) -> tuple[np.ndarray, np.ndarray]:
    """key_ids of a .npz trace, on its columns."""
    stage = cf.column("stage")
    if stage is None:
        return np.zeros(0, np.int32), np.zeros(0, np.int32)
    kinds = cf.values["kind"]
    kind_all = cf.cols["kind_codes"]
    sched_kind = np.array([is_schedule_span(k, 0) for k in kinds], dtype=bool)
    rows = np.flatnonzero(sched_kind[kind_all] & (stage >= 0))
    kind, n = kind_all[rows], len(rows)

    def col(name: str) -> np.ndarray:
        arr = cf.column(name, rows)
        return np.full(n, -1, dtype=np.int64) if arr is None else arr

    partner, has_partner = cf.column("partner", rows), cf.column("partner_set", rows)
    if partner is None:
        partner, has_partner = np.zeros((n, 2), dtype=np.int64), np.zeros(n, dtype=bool)
    mb = col("mb")
    part, parts = np.full(n, -1, dtype=np.int32), _Parts()
    dotted = _dotted(kinds, kind)
    names = cf.column("name_codes", rows[dotted])
    if names is not None:  # Span.label is the name where it has one: one parse per distinct name
        table = np.array([parts.code(v) if v else -2 for v in cf.values["name"]], dtype=np.int32)
        part[dotted] = table[names]
    unnamed = dotted if names is None else dotted[part[dotted] == -2]
    streams = cf.values["stream"]
    for j in unnamed.tolist():  # else the name the other fields make
        m, p = int(mb[j]), (int(partner[j, 0]), int(partner[j, 1])) if has_partner[j] else None
        label = span_name(kinds[kind[j]], int(stage[rows[j]]), None if m < 0 else m, p,
                          streams[cf.cols["stream_codes"][rows[j]]])
        part[j] = parts.code(label)
    keys = (part, partner[:, 1], partner[:, 0], has_partner, mb, stage[rows], kind, cf.cols["rank"][rows])
    return rows.astype(np.int32), _ids(keys)
