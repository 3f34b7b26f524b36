"""The HTML view of traces: one self-contained file with an interactive canvas timeline (wheel = zoom, drag = pan,
hover = details), the per-rank breakdown as an embedded PNG and the comparison's tables. The layout and colours
are the static pictures' (traces.drawing.view), so both show the same cells.
"""
from __future__ import annotations

import base64
import html
import io
import json
from importlib import resources
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from traces.names import RANGE_KIND, STEP_KIND
from traces.drawing.path_marks import PATH_COLOR, paths_for, place
from traces.trace import Trace
from traces.drawing.view import COLORS, build_layout, draw_breakdown, titles_for

# the page: markup, style and the canvas script, with __TITLE__, __LEGEND__, __PNG__, __COMPARISON__, __DATA__ and
# __PATHCOLOR__ filled in by write_html (package data, so it reads as HTML and JavaScript)
_PAGE = "html_view.html"


def write_html(path: Path, traces: list[Trace], title: str = "", comparison_html: str = "",
               streams: tuple[str, ...] | None = None, critical: bool = True, paths: dict | None = None) -> Path:
    """One self-contained HTML file: an interactive canvas timeline (wheel = zoom, drag = pan, hover = details),
    the per-rank breakdown as an embedded PNG, and the comparison tables when given. `critical`: outline each
    trace's critical path in red (traces.drawing.path_marks; `paths` if already found)."""
    titles = titles_for(traces)
    lay = build_layout(traces, titles, streams)
    if critical and paths is None:
        paths = paths_for(traces)[0]
    marks = place(paths, lay.cell_of, lay.origins, traces) if critical else []
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
        "crit": [[m.trace, m.row, m.lane, round(m.start, 3), round(m.end, 3), m.label] for m in marks],
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
                                    ("kernel", "kernel"), ("nccl", "NCCL"), ("memcpy", "memcpy"))) + \
        (f'<span class="sw" style="background:none;border:2px solid {PATH_COLOR}"></span>critical path'
         if marks else "")
    page = resources.files("traces.drawing").joinpath(_PAGE).read_text(encoding="utf-8")
    doc = page.replace("__TITLE__", html.escape(title or "mhc-pipe trace")) \
        .replace("__LEGEND__", legend).replace("__PNG__", png).replace("__COMPARISON__", comparison_html) \
        .replace("__PATHCOLOR__", PATH_COLOR) \
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
            rule = all(set(c) <= set("-: ") for c in cells) and any("-" in c for c in cells)  # |---|:--|
            if all(c == "" for c in cells) or rule:
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

