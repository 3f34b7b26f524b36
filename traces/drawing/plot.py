"""Timeline pictures of a `Trace`: one row per rank, coloured cells per op kind, micro-batch labels.

Colours follow the DeepSeek DualPipe figures: F orange, I/B green, W blue, overlapped F&B split orange/green
with a shared black border; communication grey. Uses matplotlib's Agg backend (no display needed).
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.collections import PatchCollection
from matplotlib.patches import Patch, Rectangle

from traces.trace import Span, Trace

KIND_COLORS = {
    "F": "#f4a259",
    "I": "#8cc084",
    "B": "#5b9e4d",
    "W": "#5b8ec9",
    "SEND_F": "#bdbdbd",
    "RECV_F": "#bdbdbd",
    "SEND_B": "#9e9e9e",
    "RECV_B": "#9e9e9e",
    "RC": "#b07cc6",
    "OPT": "#e0e0e0",
}
OTHER_COLOR = "#cfcfcf"
# second direction of a bidirectional schedule (DualPipe): darker tones, as in DeepSeek's figure
SECOND_DIRECTION_COLORS = {"F": "#d9822b", "I": "#5f9c55", "B": "#3b7a30", "W": "#2f64a3"}
MAX_LABELLED_CELLS = 4000  # beyond this, labels are unreadable and slow to draw


def _cell_text(span: Span) -> str:
    return "" if span.mb is None else str(span.mb)


def draw_timeline(ax, trace: Trace, streams: tuple[str, ...] = ("compute",), y0: float = 0.0,
                  label_prefix: str = "", row_height: float = 0.8) -> list[float]:
    """Draw `trace` rows (one per rank, stream) onto `ax` starting at row y0; returns the row centres."""
    ranks = trace.ranks
    rows = [(r, st) for r in ranks for st in streams]
    row_of = {key: y0 + i for i, key in enumerate(rows)}
    spans = [s for s in trace.spans if (s.rank, s.stream) in row_of and s.duration > 0]
    labelled = len(spans) <= MAX_LABELLED_CELLS
    second = _second_direction_stages(trace)

    def color(kind: str, stage: int | None) -> str:
        if stage in second and kind in SECOND_DIRECTION_COLORS:
            return SECOND_DIRECTION_COLORS[kind]
        return KIND_COLORS.get(kind, OTHER_COLOR)

    patches, colors, pair_frames = [], [], []
    for s in spans:
        y = row_of[(s.rank, s.stream)] - row_height / 2
        if s.kind == "FB":
            # forward half then backward half, one thick black border around the overlapped pair
            half = s.duration / 2
            patches.append(Rectangle((s.start, y), half, row_height))
            colors.append(color("F", s.stage))
            patches.append(Rectangle((s.start + half, y), half, row_height))
            colors.append(color("B", s.partner[0] if s.partner else None))
            pair_frames.append(Rectangle((s.start, y), s.duration, row_height))
        else:
            patches.append(Rectangle((s.start, y), s.duration, row_height))
            colors.append(color(s.kind, s.stage))
    ax.add_collection(PatchCollection(patches, facecolors=colors, edgecolors="black", linewidths=0.4))
    if pair_frames:
        ax.add_collection(PatchCollection(pair_frames, facecolors="none", edgecolors="black", linewidths=1.4))
    if labelled:
        for s in spans:
            yc = row_of[(s.rank, s.stream)]
            fs = 6 if s.duration < 1.5 * _unit(trace) else 7
            if s.kind == "FB" and s.partner is not None:
                ax.text(s.start + s.duration / 4, yc, str(s.mb), ha="center", va="center", fontsize=fs)
                ax.text(s.start + 3 * s.duration / 4, yc, str(s.partner[1]), ha="center", va="center", fontsize=fs)
            else:
                ax.text(s.start + s.duration / 2, yc, _cell_text(s), ha="center", va="center", fontsize=fs)
    return [row_of[k] for k in rows]


def _second_direction_stages(trace: Trace) -> set[int]:
    """The stages drawn in the darker tones: DualPipe's second direction, DualPipeV's second chunk (the V's way
    back: the second half of its one chain of 2P stages)."""
    pipelines = trace.meta.get("pipelines") or []
    if len(pipelines) == 2:
        return set(pipelines[1])
    sch = trace.meta.get("schedule") if isinstance(trace.meta.get("schedule"), dict) else {}
    v_shape = sch.get("stages_per_rank") == 2 if "stages_per_rank" in sch else sch.get("kind") == "dualpipev"
    if v_shape and len(pipelines) == 1 and len(pipelines[0]) % 2 == 0:
        return set(pipelines[0][len(pipelines[0]) // 2:])
    return set()


def _unit(trace: Trace) -> float:
    durations = sorted(s.duration for s in trace.spans if s.duration > 0)
    return durations[len(durations) // 2] if durations else 1.0


def plot_schedule(trace: Trace, path: str | Path, title: str = "", streams: tuple[str, ...] = ("compute",)) -> Path:
    """Write a PNG or SVG picture of `trace`: one row per rank (top = rank 0)."""
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg"):
        raise ValueError(f"picture output must end in .png or .svg, got {path.name!r}")
    nrows = len(trace.ranks) * len(streams)
    makespan = trace.makespan()
    width = min(40.0, max(8.0, 0.2 * makespan / max(_unit(trace), 1e-12)))
    fig, ax = plt.subplots(figsize=(width, 0.45 * nrows + 1.4))
    centres = draw_timeline(ax, trace, streams=streams)
    ax.set_yticks(centres)
    ax.set_yticklabels([f"rank {r}" + (f" {st}" if len(streams) > 1 else "") for r in trace.ranks for st in streams])
    ax.set_ylim(len(centres) - 0.5, -0.5)
    t0 = trace.start()
    ax.set_xlim(t0, t0 + makespan)
    unit = trace.meta.get("time_unit", "us")
    ax.set_xlabel(f"time ({unit})")
    legend = [Patch(facecolor=KIND_COLORS[k], edgecolor="black", label=lbl) for k, lbl in
              (("F", "F forward"), ("B", "B backward / F&B second half"), ("I", "I input-grad"),
               ("W", "W weight-grad"))]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.35 if nrows < 6 else -0.12),
              ncol=4, fontsize=8, frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
