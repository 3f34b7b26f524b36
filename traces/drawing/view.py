"""Pictures of traces: PNG/SVG (matplotlib); the interactive HTML file is traces.drawing.html_view, on the same layout.

One row per rank and stream (logical streams first, then step / range / cpu rows, then CUDA streams), cells
coloured by kind (F orange, I/B green, W blue, overlapped F&B split orange|green, P2P grey, mHC parts and
recompute purple, kernels slate), micro-batch numbers in cells that are wide enough, predicted rows above
measured rows on one time axis (each trace starts at its first schedule op), empty stretches of a row are
bubbles and each compute row is annotated with its idle share; the critical path of each trace (its median step)
is outlined in red and joined by a red line (traces.drawing.path_marks). Below: time per rank split into kinds, exposed
communication and idle. Spans that overlap without nesting on one stream are drawn in thinner lanes.

Drawing is vectorised (one PolyCollection), so 10^5 spans render in a few seconds; labels are only drawn
where they fit and at most `MAX_LABELS` of them.
"""
from __future__ import annotations

import bisect
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.collections import PolyCollection
from matplotlib.patches import Patch
from matplotlib.transforms import blended_transform_factory

from traces.formats.chrome import assign_lanes, is_predicted
from traces.analysis.compare import _kind_order
from traces.analysis.time_stats import TimeStats, time_stats
from traces.analysis.matching import schedule_spans
from traces.columns import columns_of
from traces.names import RANGE_KIND, STEP_KIND
from traces.drawing.path_marks import PATH_COLOR, draw_marks, paths_for, place
from traces.drawing.plot import KIND_COLORS, SECOND_DIRECTION_COLORS, _second_direction_stages
from traces.trace import Trace, TraceError

MAX_LABELS = 3000
EDGE_LIMIT = 20000  # above this many cells, no black cell borders (they would be all you see)
COLORS = {**KIND_COLORS, "FB": KIND_COLORS["F"], "RG": KIND_COLORS["RC"], STEP_KIND: "#ececec",
          RANGE_KIND: "#9fb4c7", "kernel": "#546e7a", "nccl": "#9e9e9e", "memcpy": "#e0b040", "memset": "#c8a870",
          "mhc": "#b07cc6", "idle": "#ffffff", "exposed comm": "#757575",
          "A2A_DISPATCH": "#26a69a", "A2A_COMBINE": "#00796b", "WAIT": "#e57373"}
MHC_KERNELS = frozenset({"coef", "sinkhorn", "pre", "post_res"})  # mHC kernel parts (purple); other parts of an
# F/B/I/W are stretches of it (an overlapped F&B half: `F/s3/mb7/L12.block`) and take its colour
KIND_LABELS = {"FB": "F&B pair", "B.wfill": "B (W work filled in)", "exposed comm": "exposed communication"}
"""Readable names of the breakdown's kinds (an internal span kind never reaches a legend as is)."""
STREAM_ORDER = {"compute": 0, "hp": 1, "comm": 2, STEP_KIND: 3, "gpu-ranges": 4, "cpu": 5}


def color_of(kind: str, name: str = "") -> str:
    if kind in COLORS:
        if kind == "kernel" and "nccl" in name.lower():
            return COLORS["nccl"]
        return COLORS[kind]
    base, _, part = kind.partition(".")
    if part in MHC_KERNELS or (part and base not in COLORS):
        return COLORS["mhc"]
    return COLORS.get(base, "#cfcfcf")


def _stream_key(stream: str) -> tuple[int, int, str]:
    if stream in STREAM_ORDER:
        return (STREAM_ORDER[stream], 0, "")
    m = re.fullmatch(r"cuda(\d*):(\d+)", stream)
    if m:
        return (10, int(m.group(1) or 0) * 100000 + int(m.group(2)), "")
    return (20, 0, stream)


@dataclass
class Row:
    trace: int
    rank: int
    stream: str
    lanes: int
    label: str


@dataclass
class Layout:
    """Everything to draw, as flat arrays (one entry per cell; an FB span gives two cells)."""
    titles: list[str]
    rows: list[Row]
    row: np.ndarray
    lane: np.ndarray
    start: np.ndarray
    dur: np.ndarray
    color: list[str]
    text: list[str]      # micro-batch label of the cell ("" for none)
    name: list[str]      # span label (tooltips)
    kind: list[str]
    border: np.ndarray   # 1 where the cell is the first half of an FB pair (border drawn around the pair)
    t_max: float
    idle: dict[int, dict[int, float]] = field(default_factory=dict)  # trace -> rank -> idle fraction
    stats: dict[int, TimeStats] = field(default_factory=dict)  # trace -> its time budget (schedule traces)
    cell_of: dict[int, tuple[int, int]] = field(default_factory=dict)  # id(span) -> (row, lane) of its cell
    origins: dict[int, float] = field(default_factory=dict)  # trace -> its time zero on the layout
    marks: list = field(default_factory=list)  # critical path marks (traces.drawing.path_marks.Mark)


def build_layout(traces: list[Trace], titles: list[str], streams: tuple[str, ...] | None = None) -> Layout:
    rows: list[Row] = []
    cols: dict[str, list] = defaultdict(list)
    t_max = 0.0
    idle: dict[int, dict[int, float]] = {}
    stats: dict[int, TimeStats] = {}
    cell_of: dict[int, tuple[int, int]] = {}
    origins: dict[int, float] = {}
    for ti, t in enumerate(traces):
        sched = schedule_spans(t)
        origin = origins[ti] = float(columns_of(t).start[sched].min()) if len(sched) else t.start()
        if len(sched):
            st = time_stats(t)
            stats[ti] = st
            idle[ti] = {r: (v / st.makespan_us if st.makespan_us else 0.0) for r, v in st.idle.items()}
        groups: dict[tuple[int, str], list[int]] = defaultdict(list)
        for i, s in enumerate(t.spans):
            if streams is None or s.stream in streams:
                groups[(s.rank, s.stream)].append(i)
        framed = _pairs_with_halves(t, groups)
        second = _second_direction_stages(t)

        def tone(kind: str, stage: int | None, default: str) -> str:
            """DualPipe's second direction / DualPipeV's second chunk in darker tones (F, I, B, W)."""
            base = kind.split(".", 1)[0]
            if stage in second and base in SECOND_DIRECTION_COLORS and kind == base:
                return SECOND_DIRECTION_COLORS[base]
            return default

        for (rank, stream) in sorted(groups, key=lambda k: (k[0], _stream_key(k[1]))):
            idx = groups[(rank, stream)]
            lanes = assign_lanes([t.spans[i] for i in idx])
            r = len(rows)
            rows.append(Row(ti, rank, stream, max(lanes) + 1, f"{titles[ti]} r{rank}{_place(t, rank)} {stream}"))
            for i, lane in zip(idx, lanes):
                s = t.spans[i]
                cell_of.setdefault(id(s), (r, lane))
                a = s.start - origin
                t_max = max(t_max, a + s.duration)
                label = s.label
                if i in framed:  # its halves are drawn where and when they ran: the pair is only a frame
                    _push(cols, r, lane, a, s.duration, "#ffffff", "", label, s.kind, 1)
                elif s.kind == "FB" and s.partner is not None:
                    half = s.duration / 2
                    halves = ((tone("F", s.stage, COLORS["F"]), s.mb),
                              (tone("B", s.partner[0], COLORS["B"]), s.partner[1]))
                    for k, (c, mb) in enumerate(halves):
                        _push(cols, r, lane, a + k * half, half, c, str(mb), label, s.kind, 1 if k == 0 else 0)
                else:
                    if s.kind in (RANGE_KIND, STEP_KIND):
                        text = label
                    else:
                        text = "" if s.mb is None or "." in s.kind else str(s.mb)
                    _push(cols, r, lane, a, s.duration, tone(s.kind, s.stage, color_of(s.kind, s.name)), text, label,
                          s.kind, 0)
    if not rows:
        raise TraceError("nothing to draw: the trace has no spans" + (f" on streams {streams}" if streams else ""))
    return Layout(titles=titles, rows=rows, row=np.asarray(cols["row"], dtype=int),
                  lane=np.asarray(cols["lane"], dtype=int), start=np.asarray(cols["start"], dtype=float),
                  dur=np.asarray(cols["dur"], dtype=float), color=cols["color"], text=cols["text"],
                  name=cols["name"], kind=cols["kind"], border=np.asarray(cols["border"], dtype=int),
                  t_max=t_max, idle=idle, stats=stats, cell_of=cell_of, origins=origins)


def _place(t: Trace, rank: int) -> str:
    """' (pp1 dp0)' for a rank of a data-parallel run (global rank = pipeline rank x D + replica), else ''."""
    lay = t.meta.get("layout") if isinstance(t.meta.get("layout"), dict) else {}
    dp = lay.get("dp", 1)
    if not isinstance(dp, int) or dp <= 1:
        return ""
    return f" (pp{rank // dp} dp{rank % dp})"


def ms_axis(ax, unit: str, t_max: float, which: str = "x") -> str:
    """Ticks in ms for a us axis longer than 10 ms (no '1e6' offset); returns the unit the label should name."""
    if unit != "us" or t_max < 1e4:
        return unit
    from matplotlib.ticker import FuncFormatter

    axis = ax.xaxis if which == "x" else ax.yaxis
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1e3:,.0f}" if t_max >= 1e5 else f"{v / 1e3:,.1f}"))
    return "ms"


def _pairs_with_halves(t: Trace, groups) -> set[int]:
    """FB spans whose halves are spans of their own on the same row (the runtime's measured pairs)."""
    out = set()
    for idx in groups.values():
        fbs = [i for i in idx if t.spans[i].kind == "FB"]
        if not fbs:
            continue
        halves = sorted((t.spans[i].start, t.spans[i].end) for i in idx
                        if t.spans[i].kind.split(".", 1)[0] in ("F", "B"))
        starts = [a for a, _ in halves]
        for i in fbs:
            fb = t.spans[i]
            j = bisect.bisect_left(starts, fb.start)
            if j < len(halves) and halves[j][1] <= fb.end + 1e-9:
                out.add(i)
    return out


def _push(cols, row, lane, start, dur, color, text, name, kind, border) -> None:
    cols["row"].append(row)
    cols["lane"].append(lane)
    cols["start"].append(start)
    cols["dur"].append(dur)
    cols["color"].append(color)
    cols["text"].append(text)
    cols["name"].append(name)
    cols["kind"].append(kind)
    cols["border"].append(border)


# ---- matplotlib ------------------------------------------------------------------------------------------

ROW_H = 0.84


def _cell_geometry(lay: Layout) -> tuple[np.ndarray, np.ndarray]:
    nl = np.asarray([r.lanes for r in lay.rows])[lay.row]
    h = ROW_H / nl
    y0 = lay.row - ROW_H / 2 + lay.lane * h
    return y0, h


def draw_layout(ax, lay: Layout, width_px: float) -> None:
    n = len(lay.start)
    y0, h = _cell_geometry(lay)
    x0, x1 = lay.start, lay.start + lay.dur
    verts = np.stack([np.stack([x0, y0], 1), np.stack([x1, y0], 1), np.stack([x1, y0 + h], 1),
                      np.stack([x0, y0 + h], 1)], axis=1)
    # bubbles: a pale band behind every row, so empty time reads as a gap in the row
    for i, row in enumerate(lay.rows):  # a compute row's empty time is the rank idle: hatched, as in the bars
        hatch = "///" if row.stream == "compute" else None
        ax.axhspan(i - ROW_H / 2, i + ROW_H / 2, facecolor="#f7f7f7", edgecolor="#d0d0d0" if hatch else "none",
                   hatch=hatch, zorder=0, lw=0)
    edges = n <= EDGE_LIMIT
    ax.add_collection(PolyCollection(verts, facecolors=lay.color, edgecolors="black" if edges else "none",
                                     linewidths=0.3 if edges else 0, zorder=2))
    t_span = max(lay.t_max, 1e-9)
    px = lay.dur / t_span * width_px
    need = np.asarray([max(9.0, 5.5 * len(t)) if t else np.inf for t in lay.text])
    # labels only where they fit: wide enough, and in a lane of at least half a row (stacked lanes of
    # concurrent transfers leave no height for digits: they would pile into blobs)
    cand = np.nonzero((px >= need) & (h >= 0.5 * ROW_H - 1e-9))[0]
    if len(cand) <= MAX_LABELS:
        for i in cand:
            fs = 6 if px[i] < 16 or h[i] < 0.5 * ROW_H else 7
            ax.text(x0[i] + lay.dur[i] / 2, y0[i] + h[i] / 2, lay.text[i], ha="center", va="center",
                    fontsize=fs, zorder=3, clip_on=True)
    trans = blended_transform_factory(ax.transAxes, ax.transData)
    for i, row in enumerate(lay.rows):
        frac = lay.idle.get(row.trace, {}).get(row.rank)
        if row.stream == "compute" and frac is not None:
            ax.text(1.003, i, f"idle {100 * frac:.0f}%", transform=trans, fontsize=7, va="center", ha="left",
                    color="#b03030")


def _legend_handles(lay: Layout) -> list[Patch]:
    present = set(lay.kind)
    items = [("F", "F forward"), ("B", "B backward / 2nd half of F&B"), ("I", "I input-grad"), ("W", "W weight-grad"),
             ("SEND_F", "P2P"), ("A2A_DISPATCH", "EP all-to-all"), ("WAIT", "blocked on communication"),
             ("RC", "recompute / mHC kernel"), (STEP_KIND, "step"), (RANGE_KIND, "other range"),
             ("kernel", "kernel"), ("nccl", "NCCL kernel"), ("memcpy", "memcpy/memset")]
    used = set()
    for k in present:
        base = k.split(".", 1)[0]
        used.add({"FB": "F", "RECV_F": "SEND_F", "SEND_B": "SEND_F", "RECV_B": "SEND_F", "RG": "RC",
                  "memset": "memcpy", "A2A_COMBINE": "A2A_DISPATCH"}.get(base, base))
        if color_of(k) == COLORS["mhc"]:
            used.add("RC")
        if base == "FB":
            used.add("B")
    if "kernel" in present and any("nccl" in n.lower() for n, k in zip(lay.name, lay.kind) if k == "kernel"):
        used.add("nccl")
    out = [Patch(facecolor=COLORS[k], edgecolor="black", label=lbl) for k, lbl in items if k in used]
    dark = set(SECOND_DIRECTION_COLORS.values())
    if any(c in dark for c in lay.color):
        out.append(Patch(facecolor=SECOND_DIRECTION_COLORS["F"], edgecolor="black",
                         label="darker: 2nd chunk / direction (F, I, B, W)"))
    if len(lay.border) and lay.border.any():
        out.append(Patch(facecolor="none", edgecolor="black", linewidth=1.4, label="F&B pair (overlapped)"))
    if any(r.stream == "compute" for r in lay.rows):  # only compute rows draw their empty time hatched
        out.append(Patch(facecolor="#f7f7f7", edgecolor="#b0b0b0", hatch="///", label="idle (compute row empty)"))
    return out


def breakdown(trace: Trace, stats: TimeStats | None = None) -> tuple[list[int], dict[str, list[float]]]:
    """Per rank, time of one step split into kinds (schedule ops; top-level spans), exposed comm and idle; for
    traces without schedule ops, busy time per span kind (union per kind) and the rest idle."""
    ranks = trace.ranks
    parts: dict[str, list[float]] = {}
    if len(schedule_spans(trace)):
        st = stats or time_stats(trace)
        ranks = sorted(st.busy)
        kinds = sorted({k for r in ranks for k in st.rank_kind_time.get(r, {})}, key=_kind_order)
        for kind in kinds:
            parts[kind] = [st.rank_kind_time.get(r, {}).get(kind, 0.0) for r in ranks]
        # idle = makespan - busy; the exposed part of communication is shown separately from the rest
        parts["exposed comm"] = [st.exposed_comm.get(r, 0.0) for r in ranks]
        parts["idle"] = [max(st.idle.get(r, 0.0) - st.exposed_comm.get(r, 0.0), 0.0) for r in ranks]
        # overlapping compute spans (hp with compute, overlapped halves) make the parts exceed the makespan:
        # scale busy parts so every bar is exactly one makespan long
        for j, r in enumerate(ranks):
            busy_parts = sum(parts[k][j] for k in kinds)
            if busy_parts > 0:
                for k in kinds:
                    parts[k][j] *= st.busy.get(r, 0.0) / busy_parts
        return ranks, parts
    from traces.trace import union_length
    mk = trace.makespan()
    per_kind: dict[str, dict[int, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    gpu = any(s.kind in ("kernel", "memcpy", "memset") for s in trace.spans)
    for s in trace.spans:
        if s.kind in ("kernel", "memcpy", "memset"):
            k = "nccl" if s.kind == "kernel" and "nccl" in s.name.lower() else s.kind
            per_kind[k][s.rank].append((s.start, s.end))
        elif not gpu and s.kind != STEP_KIND:  # a trace of ranges only (CPU ranges, NVTX): they are the busy time
            per_kind[s.kind][s.rank].append((s.start, s.end))
    all_busy = {r: union_length([iv for k in per_kind for iv in per_kind[k][r]]) for r in ranks}
    for k in sorted(per_kind):
        parts[k] = [union_length(per_kind[k][r]) for r in ranks]
    for j, r in enumerate(ranks):  # concurrent streams: scale the kinds to the busy union of the rank
        total = sum(v[j] for v in parts.values())
        if total > 0:
            for v in parts.values():
                v[j] *= all_busy[r] / total
    parts["idle"] = [mk - all_busy[r] for r in ranks]
    return ranks, parts


def draw_breakdown(ax, traces: list[Trace], titles: list[str], stats: dict[int, TimeStats] | None = None) -> None:
    labels: list[str] = []
    bars = []
    for ti, (t, title) in enumerate(zip(traces, titles)):
        ranks, parts = breakdown(t, (stats or {}).get(ti))
        for j, r in enumerate(ranks):
            labels.append(f"{title} r{r}{_place(t, r)}")
            bars.append({k: v[j] for k, v in parts.items()})
    kinds = list(dict.fromkeys(k for b in bars for k in b))
    lefts = np.zeros(len(bars))
    for k in kinds:
        vals = np.asarray([b.get(k, 0.0) for b in bars])
        color = "#a8a04a" if k == "FB" else color_of(k)  # F&B pairs: a mix of F orange and B green
        ax.barh(np.arange(len(bars)), vals, left=lefts, color=color,
                edgecolor="black", linewidth=0.3, label=KIND_LABELS.get(k, k), hatch="//" if k == "idle" else None)
        lefts += vals
    ax.set_yticks(np.arange(len(bars)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    per_step = any(len(schedule_spans(t)) for t in traces)
    unit = traces[0].meta.get("time_unit", "us") if traces else "us"
    unit = ms_axis(ax, unit, float(lefts.max()) if len(lefts) else 0.0)
    ax.set_xlabel((f"time per step ({unit}): busy by kind, exposed communication, idle (hatched); bar length = makespan"
                   if per_step else
                   f"time over the whole trace ({unit}): busy by kind (union per rank), idle (hatched)"))
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


def render_figure(traces: list[Trace], titles: list[str], title: str = "", streams: tuple[str, ...] | None = None,
                  with_breakdown: bool = True, critical: bool = True, paths: dict | None = None):
    lay = build_layout(traces, titles, streams)
    if critical:  # the critical path of each trace, outlined in red (traces.drawing.path_marks)
        lay.marks = place(paths_for(traces)[0] if paths is None else paths, lay.cell_of, lay.origins, traces)
    nrows = len(lay.rows)
    nbars = sum(len(t.ranks) for t in traces) if with_breakdown else 0
    width = 15.0
    h_tl = min(0.3 * nrows + 1.6, 60.0)
    h_bd = 0.22 * nbars + 1.6 if with_breakdown else 0.0
    fig = plt.figure(figsize=(width, h_tl + h_bd), layout="constrained")
    if with_breakdown:
        gs = fig.add_gridspec(2, 1, height_ratios=[h_tl, h_bd])
        ax, ax2 = fig.add_subplot(gs[0]), fig.add_subplot(gs[1])
    else:
        ax, ax2 = fig.add_subplot(111), None
    draw_layout(ax, lay, width_px=width * 0.8 * 100)
    draw_marks(ax, lay.marks, [r.lanes for r in lay.rows], ROW_H)
    ax.set_yticks(range(nrows))
    ax.set_yticklabels([r.label for r in lay.rows], fontsize=7 if nrows < 60 else 5)
    ax.set_ylim(nrows - 0.5, -0.5)
    ax.set_xlim(min(0.0, float(lay.start.min())), lay.t_max * 1.002)
    for i in range(1, nrows):
        if lay.rows[i].trace != lay.rows[i - 1].trace:
            ax.axhline(i - 0.5, color="black", lw=1.2)
        elif lay.rows[i].rank != lay.rows[i - 1].rank:
            ax.axhline(i - 0.5, color="#999999", lw=0.5)
    unit = ms_axis(ax, traces[0].meta.get("time_unit", "us") if traces else "us", lay.t_max)
    ax.set_xlabel(f"time ({unit}) since each trace's first schedule op (its first span if it has none)")
    handles = _legend_handles(lay) + ([Patch(facecolor="none", edgecolor=PATH_COLOR, linewidth=1.4,
                                             label="critical path")] if lay.marks else [])
    ax.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=7, fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    if ax2 is not None:
        draw_breakdown(ax2, traces, titles, lay.stats)
    return fig


def describe_run(t: Trace) -> str:
    """One line of what a trace shows, from its meta: model, schedule and layout, residual, which step."""
    m = t.meta
    parts = []
    if m.get("model") or m.get("config"):
        parts.append(str(m.get("model") or m.get("config")))
    sch = m.get("schedule") if isinstance(m.get("schedule"), dict) else {}
    lay = m.get("layout") if isinstance(m.get("layout"), dict) else {}
    if sch.get("kind"):
        shape = f"PP{lay.get('pp', sch.get('ranks', '?'))}"
        if lay.get("dp", 1) > 1:
            shape += f" x DP{lay['dp']}"
        if lay.get("ep", 1) > 1:
            shape += f" EP{lay['ep']}"
        parts.append(f"{sch['kind']} {shape}, M={sch.get('microbatches', '?')}")
    res = m.get("residual")
    if isinstance(res, dict) and res.get("variant"):
        parts.append(f"{res['variant']} n={res.get('n', '?')}")
    elif isinstance(res, str):
        parts.append(res)
    if "step" in m and "steps" in m:
        parts.append(f"step {m['step']} of {m['steps']} after the warm-up")
    parts.append(str(m.get("source", "trace")))
    return ", ".join(parts)


def titles_for(traces: list[Trace]) -> list[str]:
    return ["pred" if is_predicted(t) else "meas" for t in traces]


def write_picture(path: Path, traces: list[Trace], title: str = "", streams: tuple[str, ...] | None = None,
                  critical: bool = True, paths: dict | None = None) -> Path:
    """`paths`: the traces' critical paths if already found (traces.drawing.path_marks.paths_for)."""
    fig = render_figure(traces, titles_for(traces), title=title, streams=streams, critical=critical, paths=paths)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
