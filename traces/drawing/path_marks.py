"""The critical path drawn over a trace's picture (traces.drawing.view, traces.drawing.html_view) and in Perfetto JSON.

Each op of the path is marked where and when it set the step time: on the row of its span (a transfer on the
receiver's comm row), over the op's interval on the path (a transfer from both sides posted to its arrival, a
wait from its op's arrival to its end), outlined in red; a red line joins consecutive ops, so the chain reads
across ranks. In Perfetto JSON each rank gets a `critical path` thread with the path's ops as slices, and flow
arrows join consecutive ops. A measured trace with several steps is marked in its median step
(traces.analysis.critical_path). Traces of more than MAX_VIEW_SPANS spans are drawn without it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from traces.formats.chrome import PREDICTED_PID_OFFSET, is_predicted
from traces.analysis.critical_path import CriticalPath, critical_path
from traces.trace import Trace, TraceError

PATH_COLOR = "#d00000"
# pictures find the path only up to this many spans: the graph costs ~20 us per span (1.1 s for the 54,737 spans of
# bench/trace_scale_ranks.py's replica), more than drawing; `mhcpipe critical-path` has no such limit
MAX_VIEW_SPANS = 100_000
PATH_TID = 900  # Perfetto thread of the path, below the stream threads (chrome.STREAM_TIDS, 10+ for others)


@dataclass(frozen=True)
class Mark:
    trace: int
    row: int
    lane: int
    start: float  # on the layout's time axis
    end: float
    label: str


def paths_for(traces: list[Trace]) -> tuple[dict[int, CriticalPath], list[str]]:
    """The critical path of each trace that has one (trace index -> path), and why the others have none."""
    out, notes = {}, []
    for i, t in enumerate(traces):
        if len(t.spans) > MAX_VIEW_SPANS:
            notes.append(f"trace {i + 1} has {len(t.spans):,} spans (more than {MAX_VIEW_SPANS:,}): its critical "
                         "path is not drawn; list it with `mhcpipe critical-path`")
            continue
        try:
            out[i] = critical_path(t)
        except TraceError as err:
            notes.append(f"no critical path for trace {i + 1}: {err}")
    return out, notes


def place(paths: dict[int, CriticalPath], cell_of: dict[int, tuple[int, int]], origins: dict[int, float],
          traces: list[Trace] | None = None) -> list[Mark]:
    """Marks on a layout: `cell_of` maps id(span) -> (row, lane) of its cell, `origins` each trace's time zero.
    The path of a data-parallel run holds the slowest replica's spans renumbered to pipeline ranks (copies:
    traces/analysis/replicas.py); with `traces` (the drawn ones) those are found by their global rank and times."""
    marks = []
    for ti, cp in paths.items():
        drawn = None
        for p in cp.path:
            cell = next((cell_of[id(s)] for s in reversed(p.spans) if id(s) in cell_of), None)
            if cell is None and cp.global_ranks and traces is not None:
                if drawn is None:
                    drawn = {_key(s, s.rank): cell_of[id(s)] for s in traces[ti].spans if id(s) in cell_of}
                cell = next((drawn[k] for s in reversed(p.spans)
                             if (k := _key(s, cp.global_ranks.get(s.rank, s.rank))) in drawn), None)
            if cell is None:
                continue  # its stream is not drawn
            a = cp.t0_us + p.start_us - origins[ti]
            marks.append(Mark(ti, cell[0], cell[1], a, a + p.duration_us, p.label))
    return marks


def _key(s, rank: int) -> tuple:
    return (rank, s.stream, s.kind, s.stage, s.mb, s.start, s.duration, s.name)


def draw_marks(ax, marks: list[Mark], lanes: list[int], row_h: float) -> None:
    """Red outlines over the marked intervals and a red line from each op's end to the next op's start."""
    from matplotlib.collections import LineCollection, PolyCollection

    if not marks:
        return
    boxes, links = [], []
    prev, prev_y = None, 0.0
    for m in marks:
        h = row_h / lanes[m.row]
        y0 = m.row - row_h / 2 + m.lane * h
        boxes.append([(m.start, y0), (m.end, y0), (m.end, y0 + h), (m.start, y0 + h)])
        if prev is not None and prev.trace == m.trace:
            links.append([(prev.end, prev_y), (m.start, y0 + h / 2)])
        prev, prev_y = m, y0 + h / 2
    ax.add_collection(PolyCollection(boxes, facecolors="none", edgecolors=PATH_COLOR, linewidths=1.4, zorder=4))
    ax.add_collection(LineCollection(links, colors=PATH_COLOR, linewidths=0.8, alpha=0.8, zorder=4))


def chrome_path_events(traces: list[Trace], paths: dict[int, CriticalPath]) -> list[dict[str, Any]]:
    """Perfetto events: per rank a `critical path` thread with the path's ops, and flows between them."""
    events: list[dict[str, Any]] = []
    for ti, cp in paths.items():
        off = PREDICTED_PID_OFFSET if is_predicted(traces[ti]) else 0
        named = set()
        prev = None
        for k, p in enumerate(cp.path):
            pid = cp.global_ranks.get(p.rank, p.rank) + off  # a data-parallel run's processes are global ranks
            if pid not in named:
                named.add(pid)
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": PATH_TID,
                               "args": {"name": "critical path"}})
                events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": PATH_TID,
                               "args": {"sort_index": -1}})
            ts = cp.t0_us + p.start_us
            events.append({"ph": "X", "name": p.label, "cat": "critical_path", "pid": pid, "tid": PATH_TID,
                           "ts": ts, "dur": p.duration_us,
                           "args": {"order": k + 1, "kind": p.kind, "phase": p.phase,
                                    "gap_before_us": p.gap_before_us}})
            if prev is not None:
                fid = (ti + 1) * 1_000_000 + k
                events.append({"ph": "s", "id": fid, "name": "critical path", "cat": "critical_path",
                               "pid": prev[0], "tid": PATH_TID, "ts": prev[1]})
                events.append({"ph": "f", "bp": "e", "id": fid, "name": "critical path", "cat": "critical_path",
                               "pid": pid, "tid": PATH_TID, "ts": ts})
            prev = (pid, ts)
    return events
