"""Our own trace format read back (traces.trace.Trace.from_dict / load): every span as written, optional fields at
the Span's defaults, and a malformed file refused in one line naming the field; the reader checks 10^6 spans as
TypedDicts (bench/trace_scale_runs.py), so these pin what the schema promised before."""
from __future__ import annotations

import json

import pytest

from schedules import build, simulate
from traces.trace import Span, Trace, TraceError

HEAD = {"format": "mhc-pipe-trace", "version": 1}


def test_a_written_trace_reads_back_span_for_span(tmp_path):
    sim = simulate(build("dualpipev", 4, 8)).trace
    extra = [Span(1, "comm", "SEND_F", 2, 3, 5.0, 1.5, peer=2, name="SEND_F/s2/mb3~comm", group="pp:1,2", batch=7),
             Span(0, "compute", "OPT", None, None, 9.0, 0.25)]
    trace = Trace(spans=sim.spans + extra, meta={**sim.meta, "note": "x"})
    back = Trace.load(trace.save(tmp_path / "t.json"))
    assert back.spans == trace.spans and back.meta == trace.meta
    assert any(s.partner is not None and isinstance(s.partner, tuple) for s in back.spans)


def test_optional_fields_take_the_span_defaults():
    got = Trace.from_dict({**HEAD, "spans": [{"rank": 0, "stream": "compute", "kind": "F", "start": 1,
                                              "duration": 2}]})
    assert got.spans == [Span(0, "compute", "F", None, None, 1.0, 2.0)] and got.meta == {}


@pytest.mark.parametrize("span, field", [
    ({"rank": 0, "stream": "compute", "kind": "F", "start": 0, "duration": 1, "code": "x"}, "spans.0.code"),
    ({"rank": -1, "stream": "compute", "kind": "F", "start": 0, "duration": 1}, "spans.0.rank"),
    ({"rank": 0, "stream": "", "kind": "F", "start": 0, "duration": 1}, "spans.0.stream"),
    ({"rank": 0, "stream": "compute", "kind": "F", "start": 0, "duration": -1}, "spans.0.duration"),
    ({"rank": 0, "stream": "compute", "kind": "F", "duration": 1}, "spans.0.start"),
    ({"rank": 0, "stream": "compute", "kind": "F", "start": 0, "duration": 1, "partner": [1]}, "spans.0.partner"),
    ({"rank": 0, "stream": "compute", "kind": "F", "start": 0, "duration": 1, "batch": -2}, "spans.0.batch"),
])
def test_a_malformed_span_is_refused_naming_its_field(span, field):
    with pytest.raises(TraceError, match=rf"^<dict>: field {field}(\.\d+)?: "):
        Trace.from_dict({**HEAD, "spans": [span]})


def test_an_unknown_top_level_field_is_refused():
    with pytest.raises(TraceError, match="field extra: Extra inputs are not permitted"):
        Trace.from_dict({**HEAD, "extra": 1, "spans": []})


def _v2(columns: dict) -> dict:
    return {"format": "mhc-pipe-trace", "version": 2, "columns": columns}


COLS = {"rank": [0, 1], "stream": {"values": ["compute"], "codes": [0, 0]},
        "kind": {"values": ["F", "B"], "codes": [0, 1]}, "start": [0.0, 2.0], "duration": [1.0, 1.5]}


def test_version_1_and_version_2_files_of_a_trace_read_back_the_same(tmp_path):
    sim = simulate(build("zb1p", 3, 6)).trace
    measured = [Span(2, "comm", "RECV_B", 1, 0, 4.0, 0.5, peer=1, name="RECV_B/s1/mb0~comm", group="p2p:1>2", batch=3)]
    trace = Trace(spans=sim.spans + measured, meta={"source": "x"})
    path = trace.save(tmp_path / "t.json")
    assert '"version": 2' in path.read_text()[:200] and '"columns"' in path.read_text()
    old = tmp_path / "old.json"
    old.write_text(json.dumps(trace.to_records()))
    assert Trace.load(old).spans == Trace.load(path).spans == trace.spans


def test_columns_left_out_take_the_span_defaults():
    got = Trace.from_dict(_v2(COLS))
    assert got.spans == [Span(0, "compute", "F", None, None, 0.0, 1.0), Span(1, "compute", "B", None, None, 2.0, 1.5)]


@pytest.mark.parametrize("change, message", [
    ({"start": [0.0, "x"]}, r"field columns\.start\.1: "),
    ({"duration": [1.0, -1.0]}, r"field columns\.duration\.1: "),
    ({"rank": [0, -1]}, r"field columns\.rank\.1: "),
    ({"code": [1, 2]}, r"field columns\.code: Extra inputs"),
    ({"kind": {"values": ["F"], "codes": [0, 1]}}, r"field columns\.kind\.codes: code 1 names no value"),
    ({"kind": {"values": ["F", ""], "codes": [0, 1]}}, r"field columns\.kind\.values\.1: "),
    ({"duration": [1.0]}, r"field columns\.duration: 1 values for 2 spans"),
    ({"mb": [0]}, r"field columns\.mb: 1 values for 2 spans"),
])
def test_a_damaged_column_is_refused_naming_it(change, message):
    with pytest.raises(TraceError, match=rf"^<dict>: {message}"):
        Trace.from_dict(_v2({**COLS, **change}))


def test_an_unknown_version_names_the_ones_read():
    with pytest.raises(TraceError, match=r"version 3 is not supported \(this build reads versions 1, 2\)"):
        Trace.from_dict({"format": "mhc-pipe-trace", "version": 3, "columns": COLS})


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 18])
def test_spans_are_read_in_chunks_from_the_end_in_file_order(tmp_path, monkeypatch, chunk):
    """The reader makes the spans a chunk at a time, last chunk first, cutting the columns behind it: any chunk
    size (one span, one that does not divide the count, one larger than the trace) gives the spans in file order."""
    import traces.trace_json as T

    sim = simulate(build("dualpipev", 4, 8)).trace
    extra = [Span(1, "comm", "SEND_F", 2, 3, 5.0, 1.5, peer=2, name="SEND_F/s2/mb3~comm", group="pp:1,2", batch=7)]
    trace = Trace(spans=extra + sim.spans + extra, meta=dict(sim.meta))
    path = trace.save(tmp_path / "t.json")
    monkeypatch.setattr(T, "SPAN_CHUNK", chunk)
    assert Trace.load(path).spans == trace.spans


def test_a_dict_is_given_away_only_when_the_caller_says_so():
    """from_dict leaves the caller's dict as it was; consume=True (a file just parsed) drops its span columns
    once validated, and the spans are the same."""
    data = _v2(COLS)
    first = Trace.from_dict(data)
    assert Trace.from_dict(data).spans == first.spans  # read twice: nothing taken from it
    assert Trace.from_dict(data, consume=True).spans == first.spans
    assert "columns" not in data


@pytest.mark.parametrize("encoding", ["utf-8", "utf-8-sig"])
def test_json_files_with_or_without_a_byte_order_mark_still_read(tmp_path, encoding):
    """The reader decodes the bytes itself (so they are freed before the parse), as json.loads would: UTF-8 with
    or without the byte order mark some Windows tools write."""
    from traces.formats.io import load_trace

    sim = simulate(build("1f1b", 2, 4)).trace
    path = tmp_path / "t.json"
    path.write_bytes(json.dumps(sim.to_dict()).encode(encoding))
    assert load_trace(path).spans == sim.spans
