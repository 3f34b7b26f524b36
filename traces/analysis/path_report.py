"""Tables for the critical path, the what-if replay, the communication overlap and mHC's overhead along the path:
(title, header, rows) sections written as plain text or Markdown. Times in the trace's unit (us), shares in % of
the step's makespan."""
from __future__ import annotations

import math
from typing import Any

Section = tuple[str, list[str], list[list[str]]]
MAX_PATH_ROWS = 40


def _f(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.{digits}f}"


def _pct(x: float, total: float) -> str:
    return _f(100.0 * x / total) if total else "-"


def path_sections(cp: dict[str, Any], title: str = "Critical path", max_rows: int = MAX_PATH_ROWS) -> list[Section]:
    """Sections for one critical path (CriticalPath.to_dict())."""
    mk = cp["makespan_us"]
    mhc = cp["parts"].get("mhc", 0.0)
    head = [["makespan (one step)", _f(mk), "100.0"],
            ["path length: ops on the path", _f(cp["length_us"]), _pct(cp["length_us"], mk)],
            ["gaps: delays between them", _f(cp["gaps_us"]), _pct(cp["gaps_us"], mk)],
            ["exposed communication: transfers and collectives on the path", _f(cp["exposed_comm_us"]),
             _pct(cp["exposed_comm_us"], mk)],
            ["waits' own time on the path", _f(cp["wait_us"]), _pct(cp["wait_us"], mk)],
            ["mHC kernel parts (coef, sinkhorn, pre, post_res) inside the path's ops", _f(mhc), _pct(mhc, mk)],
            ["ops on the path", str(len(cp["path"])), ""]]
    scope = f"; {cp['scope']}" if cp.get("scope") else ""
    out: list[Section] = [(f"{title} (step {cp['step']} of {cp['steps']}, us{scope})", ["", "us", "% of makespan"],
                           head)]
    rows = []
    for dim, key in (("kind", "by_kind"), ("rank", "by_rank"), ("stream", "by_stream"), ("phase", "by_phase")):
        for k, v in sorted(cp[key].items(), key=lambda kv: -kv[1]):
            rows.append([dim, str(k), _f(v), _pct(v, mk)])
    for k, v in cp["gaps_by_rank"].items():
        if v:
            rows.append(["gaps on rank" if k != "step end" else "gap", str(k), _f(v), _pct(v, mk)])
    out.append((f"{title}: where its time goes", ["by", "", "us", "% of makespan"], rows))
    path = list(enumerate(cp["path"], 1))
    shown = path if len(path) <= max_rows else path[: max_rows // 2] + path[-max_rows // 2:]
    prow = []
    for i, (n, p) in enumerate(shown):
        if len(path) > max_rows and i == max_rows // 2:
            prow.append(["...", "", f"{len(path) - max_rows} more", "", "", "", "", ""])
        prow.append([str(n), str(p["rank"]), p["label"], p["kind"], p["phase"], _f(p["start_us"]),
                     _f(p["duration_us"]), _f(p["gap_before_us"])])
    out.append((f"{title}: the ops in order", ["#", "rank", "op", "kind", "phase", "start us", "us", "gap before us"],
                prow))
    if cp.get("violations"):
        out.append(("Dependencies the recorded times contradict (left out)", ["", ""],
                    [[str(len(cp["violations"])), "; ".join(cp["violations"][:5])]]))
    return out


def compare_sections(paths: dict[str, Any]) -> list[Section]:
    """Predicted vs measured critical paths (and mHC's overhead along them) from Comparison.critical_path."""
    pred, meas = paths.get("pred"), paths.get("meas")
    if not pred or not meas:
        return []
    mp, mm = pred["makespan_us"], meas["makespan_us"]
    rows = [["makespan", _f(mp), _f(mm), "", ""],
            ["path length (ops)", _f(pred["length_us"]), _f(meas["length_us"]), _pct(pred["length_us"], mp),
             _pct(meas["length_us"], mm)],
            ["gaps", _f(pred["gaps_us"]), _f(meas["gaps_us"]), _pct(pred["gaps_us"], mp), _pct(meas["gaps_us"], mm)],
            ["exposed communication", _f(pred["exposed_comm_us"]), _f(meas["exposed_comm_us"]),
             _pct(pred["exposed_comm_us"], mp), _pct(meas["exposed_comm_us"], mm)]]
    for dim in ("by_kind", "by_phase"):
        for k in sorted(set(pred[dim]) | set(meas[dim])):
            a, b = pred[dim].get(k, 0.0), meas[dim].get(k, 0.0)
            rows.append([f"{dim[3:]} {k}", _f(a), _f(b), _pct(a, mp), _pct(b, mm)])
    out: list[Section] = [("Critical path of a step: predicted vs measured (us; %: of each makespan)",
                           ["", "predicted us", "measured us", "predicted %", "measured %"], rows)]
    ov = paths.get("overhead_on_path")
    if ov and ov.get("pred") and ov.get("meas"):
        p, m = ov["pred"], ov["meas"]
        crow = [["total overhead", _f(p["overhead_us"]), _f(m["overhead_us"]), _f(p["overhead_pct"], 2),
                 _f(m["overhead_pct"], 2)]]
        for k in p["causes_us"]:
            crow.append([k, _f(p["causes_us"][k]), _f(m["causes_us"][k]), _f(p["causes_pct"][k], 2),
                         _f(m["causes_pct"][k], 2)])
        out.append(("mHC overhead along the critical path by cause (T_mHC - T_base; %: of T_base)",
                    ["cause", "predicted us", "measured us", "predicted %", "measured %"], crow))
    return out


def whatif_sections(w: dict[str, Any]) -> list[Section]:
    scales = ", ".join(f"{k}={v:g}" for k, v in w["scales"].items()) or "none"
    rows = [["measured step (median over steps)", _f(w["measured_step_us"])],
            ["replayed as recorded", f"{_f(w['replay_step_us'])} (max error {w['reproduction_error_pct']:.2g}%)"],
            [f"predicted with {scales}", f"{_f(w['step_us'])} ({_f(w['change_pct'], 2)}%)"],
            ["mhc means", w["mhc_source"]]]
    if w.get("baseline_step_us") is not None:
        bs, ms = w["baseline_step_us"], w["measured_step_us"]
        rows.insert(1, ["baseline's measured step (--baseline, median over its steps)",
                        f"{_f(bs)} (the mHC run {_f(100 * (ms / bs - 1), 2)}% slower; predicted "
                        f"{_f(100 * (w['step_us'] / bs - 1), 2)}%)"])
    out: list[Section] = [("What-if replay (us per step)", ["", ""], rows)]
    b, a = w["critical_path_before"], w["critical_path_after"]
    rows = [["length", _f(b["length_us"]), _f(a["length_us"])], ["gaps", _f(b["gaps_us"]), _f(a["gaps_us"])],
            ["exposed communication", _f(b["exposed_comm_us"]), _f(a["exposed_comm_us"])]]
    for k in sorted(set(b["by_kind"]) | set(a["by_kind"])):
        rows.append([f"kind {k}", _f(b["by_kind"].get(k, 0.0)), _f(a["by_kind"].get(k, 0.0))])
    out.append((f"Critical path of step {b['step']}: as recorded and after scaling (us)", ["", "recorded", "scaled"],
                rows))
    return out


def overlap_sections(o: dict[str, Any]) -> list[Section]:
    rows = [[r, o["basis"][r], str(s["spans"]), _f(s.get("wall_us")), _f(s["comm_us"]), _f(s["overlapped_us"]),
             _f(s["overlap_pct"])] for r, s in o["per_rank"].items()]
    out: list[Section] = [("Communication under compute per rank (share of each comm span's time with compute "
                           "running on its rank; comm in flight = wall time with at least one comm span open, span "
                           "time = their durations summed, concurrent spans each counted)",
                           ["rank", "comm spans are", "spans", "in flight us", "span time us", "under compute us",
                            "%"], rows)]
    out.append(("Per rank and stream", ["rank", "stream", "spans", "span time us", "under compute us", "%"],
                [[str(d["rank"]), d["stream"], str(d["spans"]), _f(d["comm_us"]), _f(d["overlapped_us"]),
                  _f(d["overlap_pct"])] for d in o["per_stream"]]))
    un = [[r, k, str(int(v["count"])), _f(v["us"])] for r, u in o["unmatched"].items() for k, v in list(u.items())[:8]]
    if un:
        out.append(("Spans neither communication nor compute (first 8 per rank by time)",
                    ["rank", "kind: name", "count", "us"], un))
    return out


def to_text(sections: list[Section], notes: list[str] = ()) -> str:
    lines = []
    for title, header, rows in sections:
        lines.append(title)
        widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)] if rows else [len(h) for h in header]
        if any(header):
            lines.append(("  " + "  ".join(h.ljust(w) for h, w in zip(header, widths))).rstrip())
        for row in rows:
            lines.append(("  " + "  ".join(str(x).ljust(w) for x, w in zip(row, widths))).rstrip())
        lines.append("")
    lines.extend(f"note: {n}" for n in notes)
    return "\n".join(lines).rstrip() + "\n"


def to_markdown(sections: list[Section], notes: list[str] = (), level: str = "##") -> str:
    lines = []
    for title, header, rows in sections:
        lines += [f"{level} {title}", ""]
        hdr = header if any(header) else ["", ""]
        lines.append("| " + " | ".join(h or " " for h in hdr) + " |")
        lines.append("|" + "|".join(" --- " if i == 0 else " ---: " for i in range(len(hdr))) + "|")
        lines += ["| " + " | ".join(str(x).replace("|", "\\|") for x in row) + " |" for row in rows]
        lines.append("")
    if notes:
        lines += [f"{level} Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)
