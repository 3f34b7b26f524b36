"""Chrome / Perfetto trace-event JSON: export, import and a structural check (traces.md §4).

Layout: measured rank r is process r, predicted rank r is process 1000+r (the process name says which);
threads are logical streams (tid 1 compute, 2 high-priority compute, 3 comm, then other streams such as
`cuda:7` or `cpu` from 10 up in name order). Spans that overlap without nesting on one stream (the two halves
of an overlapped F&B pair, measured) go to extra lanes `tid + 1000*k` named `<stream> #k`, so X events never
cross on one tid. A flow arrow joins each SEND span to its RECV span. When a predicted and a measured trace
are written together, each measured span's args carry `pred_us`, `meas_us` and `err_pct`.

The whole `Trace.meta` of each trace travels in `otherData.mhc_pipe`, so our JSON -> Chrome JSON -> our JSON
is lossless. `load_chrome` also reads foreign Chrome JSON (X events and B/E pairs; names parsed per §5).
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from traces.analysis.matching import match_spans
from traces.names import RANGE_KIND, parse_name
from traces.trace import STREAMS, Span, Trace, TraceError, span_name

PREDICTED_PID_OFFSET = 1000
STREAM_TIDS = {name: i + 1 for i, name in enumerate(STREAMS)}
FIRST_OTHER_TID = 10
LANE_TID_STEP = 1000
PRODUCER = "mhc-pipe"


def is_predicted(trace: Trace) -> bool:
    return trace.meta.get("source") in ("predicted", "simulated")


def _pid(trace: Trace, rank: int) -> int:
    return rank + (PREDICTED_PID_OFFSET if is_predicted(trace) else 0)


def stream_tids(streams: set[str]) -> dict[str, int]:
    """tid per stream: the logical streams first (1, 2, 3), then the others from 10 in name order."""
    tids = {s: STREAM_TIDS[s] for s in streams if s in STREAM_TIDS}
    for i, s in enumerate(sorted(s for s in streams if s not in STREAM_TIDS)):
        tids[s] = FIRST_OTHER_TID + i
    return tids


def assign_lanes(spans: list[Span]) -> list[int]:
    """Lane index per span (same order as `spans`) so that spans in one lane nest strictly or follow each
    other: lane 0 holds everything that already nests, overlapping-but-not-nested spans move to lane 1, 2..."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i].start, -spans[i].duration))
    stacks: list[list[float]] = []
    lane_of = [0] * len(spans)
    for i in order:
        s = spans[i]
        a, b = s.start, s.start + s.duration
        for k, stack in enumerate(stacks):
            while stack and stack[-1] <= a:
                stack.pop()
            if not stack or b <= stack[-1]:
                stack.append(b)
                lane_of[i] = k
                break
        else:
            stacks.append([b])
            lane_of[i] = len(stacks) - 1
    return lane_of


def chrome_events(trace: Trace, overlay: dict[int, dict[str, float]] | None = None) -> list[dict[str, Any]]:
    """Trace-event dicts for one trace (metadata, X slices, P2P flows). `overlay` maps a span index to extra
    args (pred_us/meas_us/err_pct)."""
    source = trace.meta.get("source", "measured")
    events: list[dict[str, Any]] = []
    for rank in trace.ranks:
        pid = _pid(trace, rank)
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": f"{source} rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        events.append({"ph": "M", "name": "process_labels", "pid": pid, "tid": 0,
                       "args": {"labels": f"{source}; distributedInfo.rank={rank}"}})
    by_lane: dict[tuple[int, str], list[int]] = defaultdict(list)
    for i, s in enumerate(trace.spans):
        by_lane[(s.rank, s.stream)].append(i)
    tids = stream_tids({s.stream for s in trace.spans})
    tid_of_span = [0] * len(trace.spans)
    named: set[tuple[int, int]] = set()
    for (rank, stream), idx in sorted(by_lane.items()):
        lanes = assign_lanes([trace.spans[i] for i in idx])
        pid = _pid(trace, rank)
        for i, lane in zip(idx, lanes):
            tid = tids[stream] + LANE_TID_STEP * lane
            tid_of_span[i] = tid
            if (pid, tid) not in named:
                named.add((pid, tid))
                label = stream if lane == 0 else f"{stream} #{lane}"
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}})
                events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                               "args": {"sort_index": tid}})
    for i, s in enumerate(trace.spans):
        args: dict[str, Any] = {"op": s.kind, "stage": s.stage, "mb": s.mb, "stream": s.stream}
        if s.partner is not None:
            args["partner_stage"], args["partner_mb"] = s.partner
        if s.peer is not None:
            args["peer"] = s.peer
        if overlay and i in overlay:
            args.update(overlay[i])
        events.append({"ph": "X", "name": s.label, "cat": s.kind, "pid": _pid(trace, s.rank), "tid": tid_of_span[i],
                       "ts": s.start, "dur": s.duration, "args": args})
    events.extend(_p2p_flows(trace, tid_of_span))
    return events


def _p2p_flows(trace: Trace, tid_of_span: list[int]) -> list[dict[str, Any]]:
    """One s/f flow pair per matched SEND/RECV (same direction, stage and micro-batch)."""
    sends: dict[tuple[str, int | None, int | None, int], int] = {}
    for i, s in enumerate(trace.spans):
        if s.kind in ("SEND_F", "SEND_B"):
            sends[(s.kind[-1], s.stage, s.mb, s.rank)] = i
    flows = []
    flow_id = 0
    for j, r in enumerate(trace.spans):
        if r.kind not in ("RECV_F", "RECV_B") or r.peer is None:
            continue
        i = sends.get((r.kind[-1], r.stage, r.mb, r.peer))  # peers are global ranks, as the runtime records them
        if i is None:
            continue
        s = trace.spans[i]
        flow_id += 1
        name = f"P2P_{r.kind[-1]}/s{r.stage}/mb{r.mb}"
        fid = flow_id + (PREDICTED_PID_OFFSET * 1000 if is_predicted(trace) else 0)
        flows.append({"ph": "s", "id": fid, "name": name, "cat": "P2P", "pid": _pid(trace, s.rank),
                      "tid": tid_of_span[i], "ts": s.start})
        flows.append({"ph": "f", "bp": "e", "id": fid, "name": name, "cat": "P2P",
                      "pid": _pid(trace, r.rank), "tid": tid_of_span[j], "ts": r.end})
    return flows


def _overlay(pred: Trace, meas: Trace) -> dict[int, dict[str, float]]:
    out = {}
    for pi, mi in match_spans(pred, meas):
        p, m = pred.spans[pi].duration, meas.spans[mi].duration
        out[mi] = {"pred_us": p, "meas_us": m, "err_pct": (100.0 * (p - m) / m) if m > 0 else None}
    return out


def to_chrome(*traces: Trace) -> dict[str, Any]:
    """A Chrome/Perfetto JSON object for one or more traces (e.g. predicted and measured in one file)."""
    pids: dict[int, str] = {}
    for t in traces:
        for r in t.ranks:
            pid = _pid(t, r)
            if pid in pids:
                raise TraceError(f"two traces put rank {r} on the same Perfetto process {pid}; write one predicted "
                                 "and one measured trace per file")
            pids[pid] = t.meta.get("source", "measured")
    preds = [t for t in traces if is_predicted(t)]
    meass = [t for t in traces if not is_predicted(t)]
    overlay = _overlay(preds[0], meass[0]) if len(preds) == 1 and len(meass) == 1 else {}
    events: list[dict[str, Any]] = []
    for t in traces:
        events.extend(chrome_events(t, overlay if t is (meass[0] if meass else None) else None))
    meta = traces[0].meta if traces else {}
    out: dict[str, Any] = {
        "traceEvents": events, "displayTimeUnit": "ns",
        "otherData": {"producer": PRODUCER, "time_unit": "us",
                      **{k: v for k, v in meta.items() if isinstance(v, (str, int, float, bool))},
                      "mhc_pipe": {"traces": [{"meta": t.meta, "predicted": is_predicted(t)} for t in traces]}},
    }
    measured_ranks = sorted({r for t in meass for r in t.ranks})
    if len(measured_ranks) == 1:
        out["distributedInfo"] = {"rank": measured_ranks[0]}
    return out


def save_chrome(path: str | Path, *traces: Trace) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_chrome(*traces)))
    return path


# ---- reading ---------------------------------------------------------------------------------------------

def chrome_to_traces(data: Any, source: str = "<chrome>") -> list[Trace]:
    """Traces in a Chrome JSON object: ours gives one per written trace (predicted, measured); a foreign file
    gives one measured trace with rank = pid."""
    if isinstance(data, list):
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise TraceError(f"{source}: not a Chrome/Perfetto trace (expected a traceEvents list)")
    other = data.get("otherData") if isinstance(data.get("otherData"), dict) else {}
    ours = other.get("producer") == PRODUCER and isinstance(other.get("mhc_pipe"), dict)
    thread_names: dict[tuple[Any, Any], str] = {}
    for ev in data["traceEvents"]:
        if isinstance(ev, dict) and ev.get("ph") == "M" and ev.get("name") == "thread_name":
            thread_names[(ev.get("pid"), ev.get("tid"))] = str((ev.get("args") or {}).get("name", ""))
    groups: dict[bool, list[Span]] = {False: [], True: []}
    open_b: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
    for n, ev in enumerate(data["traceEvents"]):
        if not isinstance(ev, dict):
            raise TraceError(f"{source}: traceEvents[{n}] is not an object")
        ph = ev.get("ph")
        if ph == "B":
            open_b[(ev.get("pid"), ev.get("tid"))].append(ev)
            continue
        if ph == "E":
            stack = open_b.get((ev.get("pid"), ev.get("tid")))
            if not stack:
                raise TraceError(f"{source}: traceEvents[{n}]: E event without a matching B on pid {ev.get('pid')} "
                                 f"tid {ev.get('tid')}")
            b = stack.pop()
            ev = {**b, "ph": "X", "dur": _time(ev, "ts", source, n) - _time(b, "ts", source, n)}
        elif ph != "X":
            continue
        ts, dur = _time(ev, "ts", source, n), _time(ev, "dur", source, n)
        if dur < 0:
            raise TraceError(f"{source}: traceEvents[{n}]: negative dur {dur}")
        pid = ev.get("pid")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid < 0:
            continue  # Kineto-style string pids ("Spans") hold no spans of a rank
        predicted = ours and pid >= PREDICTED_PID_OFFSET
        rank = pid - PREDICTED_PID_OFFSET if predicted else pid
        groups[predicted].append(_span_from_event(ev, rank, ts, dur, thread_names, ours))
    metas = {bool(t.get("predicted")): dict(t.get("meta") or {}) for t in other.get("mhc_pipe", {}).get("traces", [])} \
        if ours else {}
    out = []
    for predicted in (True, False):
        if not groups[predicted] and predicted not in metas:
            continue
        meta = metas.get(predicted) or {"source": "predicted" if predicted else "measured", "format": "chrome-json",
                                        "time_unit": "us"}
        out.append(Trace(spans=groups[predicted], meta=meta))
    if not out:
        raise TraceError(f"{source}: the Chrome trace holds no X (or B/E) events with integer pids")
    return out


def _time(ev: dict[str, Any], key: str, source: str, n: int) -> float:
    v = ev.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TraceError(f"{source}: traceEvents[{n}] ({ev.get('name')!r}): field {key!r} must be a number in "
                         f"microseconds, got {v!r}")
    return float(v) if isinstance(v, float) else v


def _span_from_event(ev: dict[str, Any], rank: int, ts: float, dur: float,
                     thread_names: dict[tuple[Any, Any], str], ours: bool) -> Span:
    args = ev.get("args") if isinstance(ev.get("args"), dict) else {}
    name = str(ev.get("name", ""))
    stream = args.get("stream")
    if not isinstance(stream, str) or not stream:
        tname = thread_names.get((ev.get("pid"), ev.get("tid")), "")
        stream = tname.split(" #", 1)[0] if tname else f"tid{ev.get('tid')}"
    if ours and isinstance(args.get("op"), str):
        kind, stage, mb = args["op"], args.get("stage"), args.get("mb")
        partner = (args["partner_stage"], args["partner_mb"]) if "partner_stage" in args else None
        peer = args.get("peer")
    else:
        parsed = parse_name(name)
        if parsed is None:  # a foreign slice: its category (e.g. "kernel") is the best kind we have
            kind = str(ev.get("cat") or RANGE_KIND) if not ours else RANGE_KIND
            stage, mb, partner, peer = None, None, None, None
        else:
            kind, stage, mb, partner, peer = parsed.kind, parsed.stage, parsed.mb, parsed.partner, None
            if not args.get("stream"):
                stream = parsed.stream if stream.startswith("tid") else stream
    label = "" if name == span_name(kind, stage, mb, partner, stream) else name
    return Span(rank, stream, kind, stage, mb, ts, dur, partner=partner, peer=peer, name=label)


def load_chrome(path: str | Path, which: str | None = None) -> Trace:
    """Read a Chrome/Perfetto JSON file (plain or gzip). A file with both a predicted and a measured trace
    needs `which` ("predicted" or "measured")."""
    from traces.formats.kineto import read_json

    path = Path(path)
    traces = chrome_to_traces(read_json(path), source=str(path))
    return pick(traces, which, str(path))


def pick(traces: list[Trace], which: str | None, source: str) -> Trace:
    if which is None:
        if len(traces) == 1:
            return traces[0]
        which = "measured"
    want = which == "predicted"
    for t in traces:
        if is_predicted(t) == want:
            return t
    raise TraceError(f"{source}: holds no {which} trace")


def validate_chrome(data: dict[str, Any]) -> list[str]:
    """Structural problems of a Chrome JSON object (empty list = fine): X events nest strictly per (pid, tid);
    every pid with slices has a process_name and every (pid, tid) a thread_name; flows pair up."""
    problems: list[str] = []
    events = data.get("traceEvents")
    if not isinstance(events, list):
        return ["traceEvents is missing or not a list"]
    pnames = {e.get("pid") for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    tnames = {(e.get("pid"), e.get("tid")) for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    slices: dict[tuple[Any, Any], list[tuple[float, float, str]]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            slices[(e.get("pid"), e.get("tid"))].append((e["ts"], e["ts"] + e["dur"], e.get("name", "")))
    for (pid, tid), items in slices.items():
        if pid not in pnames:
            problems.append(f"pid {pid} has slices but no process_name")
        if (pid, tid) not in tnames:
            problems.append(f"pid {pid} tid {tid} has slices but no thread_name")
        stack: list[tuple[float, float, str]] = []
        for a, b, name in sorted(items, key=lambda x: (x[0], -(x[1] - x[0]))):
            while stack and stack[-1][1] <= a:
                stack.pop()
            if stack and b > stack[-1][1]:
                problems.append(f"pid {pid} tid {tid}: {name!r} [{a}, {b}] crosses {stack[-1][2]!r} "
                                f"[{stack[-1][0]}, {stack[-1][1]}]")
                if len(problems) > 20:
                    return problems
            stack.append((a, b, name))
    flows: dict[Any, list[str]] = defaultdict(list)
    for e in events:
        if e.get("ph") in ("s", "t", "f") and e.get("cat") != "ac2g":
            flows[(e.get("cat"), e.get("id"))].append(e["ph"])
    for key, phs in flows.items():
        if phs.count("s") != 1 or phs.count("f") != 1:
            problems.append(f"flow {key} has phases {phs} (expected one s and one f)")
    return problems
