"""Pictures of traces: PNG/SVG (matplotlib) and one self-contained interactive HTML file.

One row per rank and stream (logical streams first, then step / range / cpu rows, then CUDA streams), cells
coloured by kind (F orange, I/B green, W blue, overlapped F&B split orange|green, P2P grey, mHC parts and
recompute purple, kernels slate), micro-batch numbers in cells that are wide enough, predicted rows above
measured rows on one time axis (each trace starts at its first schedule op), empty stretches of a row are
bubbles and each compute row is annotated with its idle share. Below: time per rank split into kinds, exposed
communication and idle. Spans that overlap without nesting on one stream are drawn in thinner lanes.

Drawing is vectorised (one PolyCollection), so 10^5 spans render in a few seconds; labels are only drawn
where they fit and at most `MAX_LABELS` of them.
"""
from __future__ import annotations

import base64
import bisect
import html
import io
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.transforms import blended_transform_factory  # noqa: E402

from traces.chrome import assign_lanes, is_predicted  # noqa: E402
from traces.compare import Comparison, TimeStats, _kind_order, schedule_spans, time_stats  # noqa: E402
from traces.names import RANGE_KIND, STEP_KIND  # noqa: E402
from traces.plot import KIND_COLORS  # noqa: E402
from traces.trace import Trace, TraceError  # noqa: E402

MAX_LABELS = 3000
EDGE_LIMIT = 20000  # above this many cells, no black cell borders (they would be all you see)
COLORS = {**KIND_COLORS, "FB": KIND_COLORS["F"], "RG": KIND_COLORS["RC"], STEP_KIND: "#ececec",
          RANGE_KIND: "#9fb4c7", "kernel": "#546e7a", "nccl": "#9e9e9e", "memcpy": "#e0b040", "memset": "#c8a870",
          "mhc": "#b07cc6", "idle": "#ffffff", "exposed comm": "#757575",
          "A2A_DISPATCH": "#26a69a", "A2A_COMBINE": "#00796b", "WAIT": "#e57373"}
MHC_KERNELS = frozenset({"coef", "sinkhorn", "pre", "post_res"})  # mHC kernel parts (purple); other parts of an
# F/B/I/W are stretches of it (an overlapped F&B half: `F/s3/mb7/L12.block`) and take its colour
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


def build_layout(traces: list[Trace], titles: list[str], streams: tuple[str, ...] | None = None) -> Layout:
    rows: list[Row] = []
    cols: dict[str, list] = defaultdict(list)
    t_max = 0.0
    idle: dict[int, dict[int, float]] = {}
    stats: dict[int, TimeStats] = {}
    for ti, t in enumerate(traces):
        sched = schedule_spans(t)
        origin = min((t.spans[i].start for i in sched), default=t.start())
        if sched:
            st = time_stats(t)
            stats[ti] = st
            idle[ti] = {r: (v / st.makespan_us if st.makespan_us else 0.0) for r, v in st.idle.items()}
        groups: dict[tuple[int, str], list[int]] = defaultdict(list)
        for i, s in enumerate(t.spans):
            if streams is None or s.stream in streams:
                groups[(s.rank, s.stream)].append(i)
        framed = _pairs_with_halves(t, groups)
        for (rank, stream) in sorted(groups, key=lambda k: (k[0], _stream_key(k[1]))):
            idx = groups[(rank, stream)]
            lanes = assign_lanes([t.spans[i] for i in idx])
            r = len(rows)
            rows.append(Row(ti, rank, stream, max(lanes) + 1, f"{titles[ti]} r{rank} {stream}"))
            for i, lane in zip(idx, lanes):
                s = t.spans[i]
                a = s.start - origin
                t_max = max(t_max, a + s.duration)
                label = s.label
                if i in framed:  # its halves are drawn where and when they ran: the pair is only a frame
                    _push(cols, r, lane, a, s.duration, "#ffffff", "", label, s.kind, 1)
                elif s.kind == "FB" and s.partner is not None:
                    half = s.duration / 2
                    for k, (c, mb) in enumerate(((COLORS["F"], s.mb), (COLORS["B"], s.partner[1]))):
                        _push(cols, r, lane, a + k * half, half, c, str(mb), label, s.kind, 1 if k == 0 else 0)
                else:
                    if s.kind in (RANGE_KIND, STEP_KIND):
                        text = label
                    else:
                        text = "" if s.mb is None or "." in s.kind else str(s.mb)
                    _push(cols, r, lane, a, s.duration, color_of(s.kind, s.name), text, label, s.kind, 0)
    if not rows:
        raise TraceError("nothing to draw: the trace has no spans" + (f" on streams {streams}" if streams else ""))
    return Layout(titles=titles, rows=rows, row=np.asarray(cols["row"], dtype=int),
                  lane=np.asarray(cols["lane"], dtype=int), start=np.asarray(cols["start"], dtype=float),
                  dur=np.asarray(cols["dur"], dtype=float), color=cols["color"], text=cols["text"],
                  name=cols["name"], kind=cols["kind"], border=np.asarray(cols["border"], dtype=int),
                  t_max=t_max, idle=idle, stats=stats)


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
    for i, row in enumerate(lay.rows):
        ax.axhspan(i - ROW_H / 2, i + ROW_H / 2, color="#f4f4f4", zorder=0, lw=0)
    edges = n <= EDGE_LIMIT
    ax.add_collection(PolyCollection(verts, facecolors=lay.color, edgecolors="black" if edges else "none",
                                     linewidths=0.3 if edges else 0, zorder=2))
    t_span = max(lay.t_max, 1e-9)
    px = lay.dur / t_span * width_px
    need = np.asarray([max(9.0, 5.5 * len(t)) if t else np.inf for t in lay.text])
    cand = np.nonzero(px >= need)[0]
    if len(cand) <= MAX_LABELS:
        for i in cand:
            fs = 6 if px[i] < 16 or h[i] < 0.5 else 7
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
    return [Patch(facecolor=COLORS[k], edgecolor="black", label=lbl) for k, lbl in items if k in used]


def breakdown(trace: Trace, stats: TimeStats | None = None) -> tuple[list[int], dict[str, list[float]]]:
    """Per rank, time of one step split into kinds (schedule ops; top-level spans), exposed comm and idle; for
    traces without schedule ops, busy time per span kind (union per kind) and the rest idle."""
    ranks = trace.ranks
    parts: dict[str, list[float]] = {}
    if schedule_spans(trace):
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
    for s in trace.spans:
        if s.kind in ("kernel", "memcpy", "memset"):
            k = "nccl" if s.kind == "kernel" and "nccl" in s.name.lower() else s.kind
            per_kind[k][s.rank].append((s.start, s.end))
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
            labels.append(f"{title} r{r}")
            bars.append({k: v[j] for k, v in parts.items()})
    kinds = list(dict.fromkeys(k for b in bars for k in b))
    lefts = np.zeros(len(bars))
    for k in kinds:
        vals = np.asarray([b.get(k, 0.0) for b in bars])
        color = "#a8a04a" if k == "FB" else color_of(k)  # F&B pairs: a mix of F orange and B green
        ax.barh(np.arange(len(bars)), vals, left=lefts, color=color,
                edgecolor="black", linewidth=0.3, label=k, hatch="//" if k == "idle" else None)
        lefts += vals
    ax.set_yticks(np.arange(len(bars)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    per_step = any(schedule_spans(t) for t in traces)
    unit = traces[0].meta.get("time_unit", "us") if traces else "us"
    ax.set_xlabel((f"time per step ({unit}): busy by kind, exposed communication, idle (hatched); bar length = makespan"
                   if per_step else f"time over the whole trace ({unit}): busy by kind (union per rank), idle (hatched)"))
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


def render_figure(traces: list[Trace], titles: list[str], title: str = "", streams: tuple[str, ...] | None = None,
                  with_breakdown: bool = True):
    lay = build_layout(traces, titles, streams)
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
    ax.set_yticks(range(nrows))
    ax.set_yticklabels([r.label for r in lay.rows], fontsize=7 if nrows < 60 else 5)
    ax.set_ylim(nrows - 0.5, -0.5)
    ax.set_xlim(min(0.0, float(lay.start.min())), lay.t_max * 1.002)
    for i in range(1, nrows):
        if lay.rows[i].trace != lay.rows[i - 1].trace:
            ax.axhline(i - 0.5, color="black", lw=1.2)
        elif lay.rows[i].rank != lay.rows[i - 1].rank:
            ax.axhline(i - 0.5, color="#999999", lw=0.5)
    unit = traces[0].meta.get("time_unit", "us") if traces else "us"
    ax.set_xlabel(f"time ({unit}) since each trace's first schedule op (its first span if it has none)")
    ax.legend(handles=_legend_handles(lay), loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=6, fontsize=7,
              frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    if ax2 is not None:
        draw_breakdown(ax2, traces, titles, lay.stats)
    return fig


def titles_for(traces: list[Trace]) -> list[str]:
    return ["pred" if is_predicted(t) else "meas" for t in traces]


def write_picture(path: Path, traces: list[Trace], title: str = "", streams: tuple[str, ...] | None = None) -> Path:
    fig = render_figure(traces, titles_for(traces), title=title, streams=streams)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_overhead(comp: Comparison, path: str | Path) -> Path:
    """Bar chart of the mHC overhead breakdown (pp of the baseline step), predicted vs measured."""
    path = Path(path)
    if comp.overhead is None:
        raise TraceError("the overhead chart needs a baseline pair (--baseline-pred and --baseline-meas)")
    o = comp.overhead
    keys = list(dict.fromkeys(list(o.breakdown_pred_pp) + list(o.breakdown_meas_pp))) + ["total"]
    pv = [o.breakdown_pred_pp.get(k, 0.0) for k in keys[:-1]] + [o.pred_pct]
    mv = [o.breakdown_meas_pp.get(k, 0.0) for k in keys[:-1]] + [o.meas_pct]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(keys) + 2), 4.2))
    x = np.arange(len(keys))
    ax.bar(x - 0.2, pv, 0.4, label="predicted", color="#5b8ec9", edgecolor="black", linewidth=0.4)
    ax.bar(x + 0.2, mv, 0.4, label="measured", color="#f4a259", edgecolor="black", linewidth=0.4)
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xticks(x)
    ax.set_xticklabels(keys, fontsize=8)
    ax.set_ylabel("percentage points of the baseline step")
    ax.set_title(f"mHC overhead: predicted {o.pred_pct:.2f}% vs measured {o.meas_pct:.2f}% "
                 f"({o.diff_pp:+.2f} pp)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- HTML ------------------------------------------------------------------------------------------------

def write_html(path: Path, traces: list[Trace], title: str = "", comparison_html: str = "",
               streams: tuple[str, ...] | None = None) -> Path:
    """One self-contained HTML file: an interactive canvas timeline (wheel = zoom, drag = pan, hover = details),
    the per-rank breakdown as an embedded PNG, and the comparison tables when given."""
    titles = titles_for(traces)
    lay = build_layout(traces, titles, streams)
    palette = sorted(set(lay.color))
    pal_idx = {c: i for i, c in enumerate(palette)}
    names = list(dict.fromkeys(lay.name))
    name_idx = {n: i for i, n in enumerate(names)}
    data = {
        "rows": [{"label": r.label, "lanes": r.lanes, "trace": r.trace, "stream": r.stream,
                  "idle": lay.idle.get(r.trace, {}).get(r.rank) if r.stream == "compute" else None} for r in lay.rows],
        "row": lay.row.tolist(), "lane": lay.lane.tolist(),
        "start": np.round(lay.start, 3).tolist(), "dur": np.round(lay.dur, 3).tolist(),
        "color": [pal_idx[c] for c in lay.color], "palette": palette,
        "text": lay.text, "name": [name_idx[n] for n in lay.name], "names": names,
        "tmax": lay.t_max,
    }
    fig, ax = plt.subplots(figsize=(12, 0.25 * sum(len(t.ranks) for t in traces) + 1.8))
    draw_breakdown(ax, traces, titles, lay.stats)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    png = base64.b64encode(buf.getvalue()).decode("ascii")
    legend = "".join(f'<span class="sw" style="background:{COLORS.get(k, "#ccc")}"></span>{html.escape(lbl)} '
                     for k, lbl in (("F", "F"), ("B", "B / F&B 2nd half"), ("I", "I"), ("W", "W"), ("SEND_F", "P2P"),
                                    ("RC", "recompute / mHC"), (STEP_KIND, "step"), (RANGE_KIND, "other range"),
                                    ("kernel", "kernel"), ("nccl", "NCCL"), ("memcpy", "memcpy")))
    doc = _HTML.replace("__TITLE__", html.escape(title or "mhc-pipe trace")) \
        .replace("__LEGEND__", legend).replace("__PNG__", png).replace("__COMPARISON__", comparison_html) \
        .replace("__DATA__", json.dumps(data, separators=(",", ":")).replace("</", "<\\/"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc, encoding="utf-8")
    return path


def markdown_tables_to_html(md: str) -> str:
    """The report's Markdown (headings, tables, bullet notes) as HTML, for embedding in the HTML view."""
    out, in_table = [], False
    for line in md.splitlines():
        if line.startswith("|"):
            cells = [c.strip().replace("\\|", "|") for c in line.strip("|").split(" | ")]
            is_header = not in_table
            if not in_table:
                out.append("<table>")
                in_table = True
            if all(c == "" for c in cells) or (all(set(c) <= set("-: ") for c in cells) and any("-" in c for c in cells)):
                continue  # blank header row or the |---| separator
            tag = "th" if is_header else "td"
            out.append("<tr>" + "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in cells) + "</tr>")
            continue
        if in_table:
            out.append("</table>")
            in_table = False
        if line.startswith("## "):
            out.append(f"<h3>{html.escape(line[3:])}</h3>")
        elif line.startswith("# "):
            out.append(f"<h2>{html.escape(line[2:])}</h2>")
        elif line.startswith("- "):
            out.append(f"<p class='note'>{html.escape(line[2:])}</p>")
    if in_table:
        out.append("</table>")
    return "\n".join(out)


_HTML = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body{font-family:system-ui,sans-serif;margin:12px;color:#222}
h1{font-size:18px;margin:4px 0} h2{font-size:16px} h3{font-size:14px;margin:14px 0 4px}
#wrap{position:relative;border:1px solid #bbb}
canvas{display:block;width:100%}
#tip{position:absolute;pointer-events:none;background:#fffbe6;border:1px solid #999;padding:4px 6px;font-size:12px;
 display:none;white-space:pre;max-width:700px;overflow:hidden}
.sw{display:inline-block;width:12px;height:12px;border:1px solid #333;margin:0 3px 0 10px;vertical-align:middle}
.hint{font-size:12px;color:#555}
table{border-collapse:collapse;font-size:12px;margin:4px 0} td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}
td:first-child,th:first-child{text-align:left} .note{font-size:12px;color:#444;margin:2px 0}
</style></head><body>
<h1>__TITLE__</h1>
<div>__LEGEND__</div>
<p class="hint">One row per rank and stream; predicted rows above measured rows; time in microseconds since each
trace's first schedule op. Empty stretches of a row are bubbles (idle share at the right of each compute row).
Mouse wheel: zoom, drag: pan, double-click: reset, hover: details.</p>
<div id="wrap"><canvas id="c"></canvas><div id="tip"></div></div>
<h3>Where the time goes, per rank</h3>
<img alt="breakdown per rank" src="data:image/png;base64,__PNG__" style="max-width:100%">
__COMPARISON__
<script>
const D=__DATA__;
const cv=document.getElementById('c'),tip=document.getElementById('tip'),ctx=cv.getContext('2d');
const RH=18,LW=190,TOP=22,N=D.start.length;
let x0=Math.min(0,...D.start.slice(0,1)),x1=D.tmax*1.002||1,drag=null;
function size(){cv.width=cv.clientWidth*devicePixelRatio;cv.height=(TOP+D.rows.length*RH+6)*devicePixelRatio;
 cv.style.height=(TOP+D.rows.length*RH+6)+'px';draw();}
function X(t){return LW+(t-x0)/(x1-x0)*(cv.clientWidth-LW-60);}
function draw(){const W=cv.clientWidth;ctx.setTransform(devicePixelRatio,0,0,devicePixelRatio,0,0);
 ctx.clearRect(0,0,W,cv.height);ctx.font='11px sans-serif';
 D.rows.forEach((r,i)=>{const y=TOP+i*RH;ctx.fillStyle='#f4f4f4';ctx.fillRect(LW,y+1,W-LW-60,RH-2);
  ctx.fillStyle='#222';ctx.textBaseline='middle';ctx.fillText(r.label,4,y+RH/2);
  if(r.idle!==null&&r.idle!==undefined){ctx.fillStyle='#b03030';ctx.fillText('idle '+Math.round(100*r.idle)+'%',W-56,y+RH/2);}
  if(i>0&&D.rows[i-1].trace!==r.trace){ctx.fillStyle='#000';ctx.fillRect(0,y-1,W,2);}});
 const lo=x0,hi=x1,edges=(N<20000);
 for(let i=0;i<N;i++){const a=D.start[i],d=D.dur[i];if(a+d<lo||a>hi)continue;
  const r=D.rows[D.row[i]],h=(RH-2)/r.lanes,y=TOP+D.row[i]*RH+1+D.lane[i]*h;
  let xa=Math.max(X(a),LW),xb=Math.min(X(a+d),W-60);if(xb<xa)continue;const w=Math.max(xb-xa,0.5);
  ctx.fillStyle=D.palette[D.color[i]];ctx.fillRect(xa,y,w,h);
  if(edges&&w>3){ctx.strokeStyle='#000';ctx.lineWidth=0.4;ctx.strokeRect(xa,y,w,h);}
  const t=D.text[i];if(t&&w>Math.max(12,6.5*t.length)&&h>8){ctx.fillStyle='#000';ctx.textAlign='center';ctx.fillText(t,xa+w/2,y+h/2);ctx.textAlign='left';}}
 ctx.fillStyle='#222';const step=nice((x1-x0)/8);for(let t=Math.ceil(x0/step)*step;t<=x1;t+=step){const x=X(t);
  ctx.fillRect(x,TOP-4,1,4);ctx.fillText(fmt(t),x+2,TOP-10);}}
function nice(v){const p=Math.pow(10,Math.floor(Math.log10(v)));for(const m of [1,2,5,10])if(m*p>=v)return m*p;return 10*p;}
function fmt(t){return Math.abs(t)>=1e6?(t/1e6).toFixed(2)+' s':Math.abs(t)>=1e3?(t/1e3).toFixed(1)+' ms':t.toFixed(0)+' us';}
function T(px){return x0+(px-LW)/(cv.clientWidth-LW-60)*(x1-x0);}
cv.addEventListener('wheel',e=>{e.preventDefault();const t=T(e.offsetX),f=e.deltaY>0?1.25:0.8;
 x0=t-(t-x0)*f;x1=t+(x1-t)*f;draw();},{passive:false});
cv.addEventListener('mousedown',e=>{drag={x:e.offsetX,a:x0,b:x1};});
window.addEventListener('mouseup',()=>{drag=null;});
cv.addEventListener('dblclick',()=>{x0=Math.min(0,D.start[0]||0);x1=D.tmax*1.002||1;draw();});
cv.addEventListener('mousemove',e=>{if(drag){const dt=(e.offsetX-drag.x)/(cv.clientWidth-LW-60)*(drag.b-drag.a);
 x0=drag.a-dt;x1=drag.b-dt;draw();return;}
 const ri=Math.floor((e.offsetY-TOP)/RH),t=T(e.offsetX);let best=-1;
 if(ri>=0&&ri<D.rows.length){for(let i=0;i<N;i++){if(D.row[i]===ri&&D.start[i]<=t&&t<=D.start[i]+D.dur[i]){
  const r=D.rows[ri],h=(RH-2)/r.lanes,y=TOP+ri*RH+1+D.lane[i]*h;if(e.offsetY>=y&&e.offsetY<=y+h){best=i;}}}}
 if(best<0){tip.style.display='none';return;}
 tip.textContent=D.names[D.name[best]]+'\n'+D.rows[D.row[best]].label+'\nstart '+D.start[best].toFixed(3)+' us, duration '+D.dur[best].toFixed(3)+' us';
 tip.style.left=(e.offsetX+14)+'px';tip.style.top=(e.offsetY+10)+'px';tip.style.display='block';});
cv.addEventListener('mouseleave',()=>{tip.style.display='none';});
window.addEventListener('resize',size);size();
</script></body></html>
"""
