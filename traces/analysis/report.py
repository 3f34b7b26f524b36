"""A `Comparison` as a plain-text table, Markdown, or JSON. Units are stated in every header: times in
microseconds on each trace's own axis, errors e = (pred - meas) / meas in %, bubble and overhead differences in
percentage points (pp)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from traces.analysis import path_report
from traces.analysis.compare import Comparison

MAX_LISTED = 10


def _f(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.{digits}f}"


def _sign(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:+.{digits}f}"


def sections(c: Comparison) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) per table; shared by the text and Markdown writers."""
    out = []
    head = [
        ["predicted", _source(c.pred)],
        ["measured", _source(c.meas)],
        ["matched ops", f"{c.matched} (measured steps: {c.steps})"],
        ["unmatched", f"{len(c.unmatched_pred)} predicted, {len(c.unmatched_meas)} measured"],
    ]
    out.append(("Inputs", ["", ""], head))
    out.append(("Makespan (one step, us)", ["predicted", "measured (median)", "measured min..max", "error %"],
                [[_f(c.makespan_pred_us), _f(c.makespan_meas_us),
                  f"{_f(c.makespan_meas_min_us)}..{_f(c.makespan_meas_max_us)}", _sign(c.makespan_err_pct)]]))
    out.append(("Per-op error by kind, e = (pred - meas) / meas",
                ["kind", "n", "signed median %", "median |e| %", "p90 |e| %", "pred mean us", "meas mean us"],
                [[k.kind, str(k.n), _sign(k.signed_median_pct), _f(k.median_abs_pct), _f(k.p90_abs_pct),
                  _f(k.pred_mean_us, 2), _f(k.meas_mean_us, 2)] for k in c.kinds]))
    if c.comm_spans:
        m = c.comm_span_meaning
        out.append((f"Communication spans, not compared per op: predicted = {m['pred']}, measured = {m['meas']}",
                    ["kind", "n", f"pred mean us ({m['pred']})", f"meas mean us ({m['meas']})"],
                    [[k.kind, str(k.n), _f(k.pred_mean_us, 2), _f(k.meas_mean_us, 2)] for k in c.comm_spans]))
    out.append(("Per rank: idle (bubble) and waiting for incoming messages, us per step",
                ["rank", "busy pred", "busy meas", "idle pred", "idle meas", "bubble pred %", "bubble meas %",
                 "bubble diff pp", "recv wait pred", "recv wait meas"],
                [[str(r.rank), _f(r.pred_busy_us), _f(r.meas_busy_us), _f(r.pred_idle_us), _f(r.meas_idle_us),
                  _f(r.pred_bubble_pct), _f(r.meas_bubble_pct), _sign(r.bubble_diff_pp), _f(r.pred_recv_wait_us),
                  _f(r.meas_recv_wait_us)] for r in c.ranks]))
    if any(r.comm_hidden_pct is not None for r in c.ranks):
        out.append(("Measured communication: time blocked on it (WAIT spans, us per step) and share hidden under "
                    "compute",
                    ["rank", "blocked us", "comm hidden %", "F&B comm hidden %"],
                    [[str(r.rank), _f(r.meas_comm_wait_us), _f(r.comm_hidden_pct), _f(r.fb_comm_hidden_pct)]
                     for r in c.ranks]))
    if c.overhead is not None:
        o = c.overhead
        out.append(("mHC overhead = T_mHC / T_base - 1",
                    ["", "T_base us", "T_mHC us", "overhead %"],
                    [["predicted", _f(o.base_pred_makespan_us), _f(o.mhc_pred_makespan_us), _f(o.pred_pct, 2)],
                     ["measured", _f(o.base_meas_makespan_us), _f(o.mhc_meas_makespan_us), _f(o.meas_pct, 2)],
                     ["pred - meas", "", "", f"{_sign(o.diff_pp, 2)} pp"]]))
        keys = list(dict.fromkeys(list(o.breakdown_pred_pp) + list(o.breakdown_meas_pp)))
        out.append(("Overhead breakdown (added time per kind / (ranks x T_base), pp)",
                    ["part", "predicted pp", "measured pp"],
                    [[k, _sign(o.breakdown_pred_pp.get(k), 2), _sign(o.breakdown_meas_pp.get(k), 2)] for k in keys]))
    if c.unmatched_pred or c.unmatched_meas:
        rows = [["only predicted", _listing(c.unmatched_pred)], ["only measured", _listing(c.unmatched_meas)]]
        out.append(("Unmatched spans (a schedule or annotation bug)", ["", ""], rows))
    return out


def _source(d: dict[str, Any]) -> str:
    bits = [str(d.get(k)) for k in ("file", "format", "source") if d.get(k)]
    return f"{' / '.join(bits)}: {d.get('spans', 0)} spans on {d.get('ranks', 0)} ranks"


def _listing(items: list[str]) -> str:
    if not items:
        return "none"
    more = f" ... and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else ""
    return ", ".join(items[:MAX_LISTED]) + more


def to_text(c: Comparison) -> str:
    return path_report.to_text(sections(c), c.notes)


def to_markdown(c: Comparison) -> str:
    lines = ["# Predicted vs measured", ""]
    for title, header, rows in sections(c):
        lines.append(f"## {title}")
        lines.append("")
        hdr = header if any(header) else ["", ""]
        lines.append("| " + " | ".join(h or " " for h in hdr) + " |")
        lines.append("|" + "|".join(" --- " if i == 0 else " ---: " for i in range(len(hdr))) + "|")
        for row in rows:
            lines.append("| " + " | ".join(str(x).replace("|", "\\|") for x in row) + " |")
        lines.append("")
    if c.notes:
        lines.append("## Notes")
        lines.append("")
        lines.extend(f"- {n}" for n in c.notes)
        lines.append("")
    return "\n".join(lines)


def to_json(c: Comparison) -> dict[str, Any]:
    d = c.to_dict()
    d["units"] = {"time": "us", "error": "percent of measured", "bubble_diff": "percentage points",
                  "overhead_diff": "percentage points"}
    return _clean(d)


def _clean(x: Any) -> Any:
    """JSON-safe: NaN -> None, tuple keys -> strings."""
    if isinstance(x, float):
        return None if math.isnan(x) or math.isinf(x) else x
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_json(c: Comparison, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(c), indent=1))
    return path


def write_markdown(c: Comparison, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_markdown(c))
    return path
