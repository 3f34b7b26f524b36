"""Range names (traces.md §5) and the Chrome/Perfetto writer/reader: lossless round trip with our JSON, a
structural check (X events nest per pid/tid, metadata names present, flows pair up), overlapping measured
spans moved to lanes, foreign Chrome files, bad input."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traces_testlib import one_f_one_b
from traces.formats.chrome import (PREDICTED_PID_OFFSET, assign_lanes, chrome_to_traces, load_chrome, save_chrome,
                           to_chrome, validate_chrome)
from traces.formats.io import load_trace
from traces.names import OPS, RangeName, format_name, parse_name
from traces.trace import Span, Trace, TraceError

# ---- names ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, expect", [
    ("F/s3/mb7", ("F", 3, 7, None, None, "compute")),
    ("FB/s3/mb7+s4/mb2", ("FB", 3, 7, (4, 2), None, "compute")),
    ("SEND_F/s3/mb7~comm", ("SEND_F", 3, 7, None, None, "comm")),
    ("F/s3/mb7/L12.post_res~hp", ("F.post_res", 3, 7, None, "L12.post_res", "hp")),
    ("mhc_pipe:RC/s0/mb1", ("RC", 0, 1, None, None, "compute")),
    (":W/s12/mb0", ("W", 12, 0, None, None, "compute")),
    ("PP:3F7", ("F", 3, 7, None, None, "compute")),
    ("2SEND_B0", ("SEND_B", 2, 0, None, None, "comm")),
    ("(3F7;4B2)OVERLAP_F_B", ("FB", 3, 7, (4, 2), None, "compute")),
])
def test_parse_convention_names(name, expect):
    p = parse_name(name)
    assert (p.kind, p.stage, p.mb, p.partner, p.part, p.stream) == expect


@pytest.mark.parametrize("name", ["F s3 mb7", "F/s3", "FB/s3/mb7", "F/s3/mb7+s4/mb2", "X/s1/mb1", "F/s3/mb7~gpu",
                                  "nccl:all_reduce", "## forward ##", ""])
def test_foreign_or_malformed_names_are_not_parsed(name):
    assert parse_name(name) is None


def test_step_names():
    assert parse_name("step/12").step == 12 and parse_name("ProfilerStep#4").kind == "step"


names = st.builds(
    RangeName,
    kind=st.sampled_from(OPS), stage=st.integers(0, 63), mb=st.integers(0, 999),
).flatmap(lambda r: st.builds(
    RangeName, kind=st.just(r.kind), stage=st.just(r.stage), mb=st.just(r.mb),
    partner=st.tuples(st.integers(0, 63), st.integers(0, 999)) if r.kind == "FB" else st.none(),
    stream=st.sampled_from(["compute", "hp", "comm"])))


@given(names)
def test_format_parse_round_trip(rn):
    assert parse_name(format_name(rn)) == rn


# ---- Chrome round trip ---------------------------------------------------------------------------------------

span_st = st.builds(
    Span, rank=st.integers(0, 5), stream=st.sampled_from(["compute", "hp", "comm", "cuda:7", "cpu"]),
    kind=st.sampled_from(["F", "B", "W", "FB", "SEND_F", "RECV_F", "kernel", "range", "F.post_res"]),
    stage=st.one_of(st.none(), st.integers(0, 15)), mb=st.one_of(st.none(), st.integers(0, 63)),
    start=st.floats(0, 1e7, allow_nan=False), duration=st.floats(0, 1e5, allow_nan=False),
    partner=st.one_of(st.none(), st.tuples(st.integers(0, 15), st.integers(0, 63))),
    peer=st.one_of(st.none(), st.integers(0, 5)), name=st.sampled_from(["", "gemm", "F/s1/mb1/L3.pre"]))


@settings(max_examples=60, deadline=None)
@given(st.lists(span_st, max_size=40), st.sampled_from(["measured", "simulated", "predicted"]))
def test_our_json_chrome_json_round_trip_is_lossless(spans, source):
    trace = Trace(spans=spans, meta={"source": source, "schedule": {"kind": "1f1b", "ranks": 6}, "x": [1, 2]})
    data = json.loads(json.dumps(to_chrome(trace)))
    assert validate_chrome(data) == []
    (back,) = chrome_to_traces(data)
    assert back.spans == trace.spans and back.meta == trace.meta


def test_file_round_trip_predicted_and_measured_in_one_file(tmp_path):
    pred = one_f_one_b(3, 4)
    meas = one_f_one_b(3, 4, f=11, b=19, source="measured", steps=2, origin=500)
    pred.save(tmp_path / "pred.json")
    path = save_chrome(tmp_path / "both.json", Trace.load(tmp_path / "pred.json"), meas)
    data = json.loads(path.read_text())
    assert validate_chrome(data) == []
    pids = {e["pid"] for e in data["traceEvents"] if e["ph"] == "X"}
    assert pids == {0, 1, 2, PREDICTED_PID_OFFSET, PREDICTED_PID_OFFSET + 1, PREDICTED_PID_OFFSET + 2}
    names = {e["pid"]: e["args"]["name"] for e in data["traceEvents"] if e.get("name") == "process_name"}
    assert names[1] == "measured rank 1" and names[1001] == "simulated rank 1"
    flows = [e for e in data["traceEvents"] if e["ph"] in ("s", "f")]
    assert len(flows) == 2 * 2 * 2 * 4 * 3  # (s, f) x (F, B) x 2 hops x 4 mbs x (1 pred + 2 meas steps)
    measured_f = [e for e in data["traceEvents"] if e["ph"] == "X" and e["pid"] < 1000 and e["cat"] == "F"]
    assert all(e["args"]["pred_us"] == 10 and e["args"]["meas_us"] == 11 for e in measured_f)
    assert measured_f[0]["args"]["err_pct"] == pytest.approx(100 * (10 - 11) / 11)
    assert load_chrome(path, which="predicted").spans == pred.spans
    assert load_trace(path).spans == meas.spans  # measured is the default pick
    assert load_trace(path, which="predicted").meta == pred.meta


def test_overlapping_spans_on_one_stream_get_lanes_not_crossing_events():
    # measured F&B halves interleave their kernels: F [0, 10] and B [5, 15] overlap without nesting
    spans = [Span(0, "compute", "F", 3, 7, 0.0, 10.0), Span(0, "compute", "B", 4, 2, 5.0, 10.0),
             Span(0, "compute", "FB", 3, 7, 0.0, 15.0, partner=(4, 2)), Span(0, "compute", "W", 4, 2, 15.0, 3.0)]
    assert assign_lanes(spans) == [0, 1, 0, 0]
    data = to_chrome(Trace(spans=spans, meta={"source": "measured"}))
    assert validate_chrome(data) == []
    tids = {e["name"]: e["tid"] for e in data["traceEvents"] if e["ph"] == "X"}
    assert tids["F/s3/mb7"] == tids["FB/s3/mb7+s4/mb2"] == 1 and tids["B/s4/mb2"] == 1001
    lane_names = {e["args"]["name"] for e in data["traceEvents"] if e.get("name") == "thread_name"}
    assert lane_names == {"compute", "compute #1"}
    # the checker itself catches crossing events
    crossing = {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "p"}},
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 1, "args": {"name": "t"}},
        {"ph": "X", "name": "a", "pid": 0, "tid": 1, "ts": 0, "dur": 10},
        {"ph": "X", "name": "b", "pid": 0, "tid": 1, "ts": 5, "dur": 10},
        {"ph": "X", "name": "c", "pid": 0, "tid": 2, "ts": 5, "dur": 10}]}
    problems = validate_chrome(crossing)
    assert any("crosses" in p for p in problems) and any("tid 2 has slices but no thread_name" in p for p in problems)


def test_foreign_chrome_json_with_begin_end_events(tmp_path):
    doc = {"traceEvents": [
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 5, "args": {"name": "main"}},
        {"ph": "B", "name": "F/s1/mb0", "pid": 2, "tid": 5, "ts": 10},
        {"ph": "B", "name": "inner", "pid": 2, "tid": 5, "ts": 12},
        {"ph": "E", "pid": 2, "tid": 5, "ts": 14},
        {"ph": "E", "pid": 2, "tid": 5, "ts": 30},
        {"ph": "X", "name": "RECV_F/s0/mb0~comm", "pid": 2, "tid": 6, "ts": 0, "dur": 5},
    ]}
    path = tmp_path / "foreign.json"
    path.write_text(json.dumps(doc))
    t = load_trace(path)
    got = sorted((s.rank, s.kind, s.stage, s.mb, s.stream, s.start, s.duration) for s in t.spans)
    assert got == [(2, "F", 1, 0, "main", 10, 20), (2, "RECV_F", 0, 0, "comm", 0, 5),
                   (2, "range", None, None, "main", 12, 2)]


def test_bad_chrome_input(tmp_path):
    with pytest.raises(TraceError, match=r"traceEvents\[0\].*'ts' must be a number"):
        chrome_to_traces({"traceEvents": [{"ph": "X", "name": "a", "pid": 0, "tid": 0, "ts": "x", "dur": 1}]})
    with pytest.raises(TraceError, match="E event without a matching B"):
        chrome_to_traces({"traceEvents": [{"ph": "E", "pid": 0, "tid": 0, "ts": 1}]})
    path = tmp_path / "t.json"
    path.write_text('{"traceEvents": [{"ph": "X", "name": "a", "pid": 0')
    with pytest.raises(TraceError, match="t.json: not valid JSON"):
        load_trace(path)
    path.write_text('{"hello": 1}')
    with pytest.raises(TraceError, match="JSON of unknown shape"):
        load_trace(path)
