"""Our own trace format read back (traces.trace.Trace.from_dict / load): every span as written, optional fields at
the Span's defaults, and a malformed file refused in one line naming the field; the reader checks 10^6 spans as
TypedDicts (bench/trace_scale_runs.py), so these pin what the schema promised before."""
from __future__ import annotations

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
