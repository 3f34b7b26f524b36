"""The HTML view of traces: one self-contained file with an interactive canvas timeline (wheel = zoom, drag = pan,
hover = details), the per-rank breakdown as an embedded PNG and the comparison's tables. The layout and colours
are the static pictures' (traces.view), so both show the same cells.
"""
from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from traces.names import RANGE_KIND, STEP_KIND  # noqa: E402
from traces.path_marks import PATH_COLOR, paths_for, place  # noqa: E402
from traces.trace import Trace  # noqa: E402
from traces.view import COLORS, build_layout, draw_breakdown, titles_for  # noqa: E402

def write_html(path: Path, traces: list[Trace], title: str = "", comparison_html: str = "",
               streams: tuple[str, ...] | None = None, critical: bool = True, paths: dict | None = None) -> Path:
    """One self-contained HTML file: an interactive canvas timeline (wheel = zoom, drag = pan, hover = details),
    the per-rank breakdown as an embedded PNG, and the comparison tables when given. `critical`: outline each
    trace's critical path in red (traces.path_marks; `paths` if already found)."""
    titles = titles_for(traces)
    lay = build_layout(traces, titles, streams)
    if critical and paths is None:
        paths = paths_for(traces)[0]
    marks = place(paths, lay.cell_of, lay.origins) if critical else []
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
    doc = _HTML.replace("__TITLE__", html.escape(title or "mhc-pipe trace")) \
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
trace's first schedule op. Empty stretches of a row are bubbles (idle share at the right of each compute row);
the critical path (the chain of ops and transfers that set the step time) is outlined in red.
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
 let pv=null;ctx.strokeStyle='__PATHCOLOR__';
 for(const [tr,ri,ln,a,b] of D.crit){const r=D.rows[ri],h=(RH-2)/r.lanes,y=TOP+ri*RH+1+ln*h;
  const xa=Math.max(X(a),LW),xb=Math.min(X(b),W-60);
  if(xb>=xa){ctx.lineWidth=2;ctx.strokeRect(xa,y,Math.max(xb-xa,1),h);}
  if(pv&&pv[0]===tr){ctx.lineWidth=1;ctx.beginPath();ctx.moveTo(X(pv[1]),pv[2]);ctx.lineTo(X(a),y+h/2);ctx.stroke();}
  pv=[tr,b,y+h/2];}
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
