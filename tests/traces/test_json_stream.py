"""traces/formats/json_stream.py (a JSON object's array read element by element) and the PyTorch profiler reader on
it (kineto.stream_kineto): the same values as json.loads at every chunk size, plain, gzip and with a byte order
mark; bad files in one line that says where; a streamed profiler file gives the trace a whole-file parse gives."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from traces.formats.io import load_trace
from traces.formats.json_stream import ObjectStream
from traces.formats.kineto import kineto_to_trace, read_json, stream_kineto
from traces.trace import TraceError

from test_traces_kineto import gpu_run_events, kineto

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "traces"
CHUNKS = (1, 2, 3, 5, 7, 64, 1 << 22)


def document() -> dict:
    """Every kind of value, and numbers and literals that a chunk's end cuts in many places."""
    events = [{"ph": "X", "ts": 1_700_000_000_000_000 + 0.125 * i, "dur": 10 ** (i % 25), "ok": i % 3 == 0,
               "none": None, "neg": -1.5e-7 * i, "name": "é☃\"\\/\t" * (i % 4), "args": {"l": [i, [], {}]}}
              for i in range(300)]
    return {"schemaVersion": 1, "distributedInfo": {"rank": 3}, "traceEvents": events,
            "traceName": "x", "after": 12345678901234567890}


def write(path: Path, doc: dict, indent: int | None, how: str) -> Path:
    text = json.dumps(doc, indent=indent, ensure_ascii=indent is None)
    raw = text.encode("utf-8")
    if how == "bom":
        raw = b"\xef\xbb\xbf" + raw
    if how == "gzip":
        raw = gzip.compress(raw)
    path.write_bytes(raw)
    return path


@pytest.mark.parametrize("how", ["plain", "gzip", "bom"])
@pytest.mark.parametrize("indent", [None, 1])
def test_elements_and_members_are_json_loads_at_every_chunk_size(tmp_path, how, indent):
    doc = document()
    path = write(tmp_path / "t.json", doc, indent, how)
    for chunk in CHUNKS:
        stream = ObjectStream(path, "traceEvents", chunk=chunk)
        assert stream.head == {"schemaVersion": 1, "distributedInfo": {"rank": 3}}
        assert list(stream.items()) == doc["traceEvents"], chunk
        assert stream.members() == {k: v for k, v in doc.items() if k != "traceEvents"}, chunk


def test_a_file_that_opens_with_another_member_is_left_unread(tmp_path):
    path = write(tmp_path / "ours.json", {"format": "x", "traceEvents": [], "schemaVersion": 1}, None, "plain")
    assert ObjectStream(path, "traceEvents", lead={"schemaVersion"}).head is None
    assert ObjectStream(path, "traceEvents").head == {"format": "x"}
    path.write_text("[1, 2]")
    assert ObjectStream(path, "traceEvents").head is None
    path.write_text('{"a": 1}')
    assert ObjectStream(path, "traceEvents").head is None  # no such array


def test_bad_files_are_one_line_saying_where(tmp_path):
    text = json.dumps(document(), indent=1)
    path = tmp_path / "t.json"
    path.write_text(text[: len(text) // 2])
    with pytest.raises(TraceError, match="may be truncated"):
        list(ObjectStream(path, "traceEvents", chunk=64).items())
    at = text.index('"ph"', len(text) // 3)  # damage a third of the way in: reported there, not at the end
    path.write_text(text[:at] + "X" + text[at + 1:])
    with pytest.raises(TraceError, match=r"traceEvents\[\d+\]: .*at character ([\d,]+)\); the file is damaged") as err:
        list(ObjectStream(path, "traceEvents", chunk=64).items())
    assert abs(int(str(err.value).split("at character ")[1].split(")")[0].replace(",", "")) - at) < 100
    path.write_bytes(gzip.compress(text.encode())[:-200])
    with pytest.raises(TraceError, match="gzip stream is damaged or truncated"):
        list(ObjectStream(path, "traceEvents").items())
    path.write_bytes(b'{"schemaVersion": 1, "traceEvents": [{"name": "\xff\xfe"}]}')
    with pytest.raises(TraceError, match="not UTF-8"):
        list(ObjectStream(path, "traceEvents").items())
    path.write_text('{"schemaVersion": 1, "traceEvents": {"a": 1}}')
    with pytest.raises(TraceError, match="traceEvents is not a list"):
        list(ObjectStream(path, "traceEvents").items())
    path.write_text('{"schemaVersion": 1, "traceEvents": [], "x": 1} extra')
    stream = ObjectStream(path, "traceEvents")
    assert list(stream.items()) == []
    with pytest.raises(TraceError, match="text after the top-level object"):
        stream.members()


def test_a_streamed_profiler_file_is_the_whole_file_parse(tmp_path, monkeypatch):
    """The reader event by event (what load_trace takes for a profiler file) against json.loads of the file, on
    a built run and on the third-party files (skipped when absent); small chunks cut every event."""
    import traces.formats.json_stream as js

    path = tmp_path / "rank1.json"
    path.write_text(json.dumps(kineto(1, gpu_run_events())))
    shared = sorted(SHARED.glob("hta_*.json.gz"))
    runs = [(f, js.CHUNK) for f in [path] + shared] + [(path, 1), (path, 7)]
    runs += [(f, 97) for f in shared if f.stat().st_size < 400_000]  # a small file, every event cut
    for f, chunk in runs:
        monkeypatch.setattr(js, "CHUNK", chunk)
        streamed = stream_kineto(f)
        whole = kineto_to_trace(read_json(f), source=str(f), file_name=f.name)
        assert streamed is not None and streamed.spans == whole.spans and streamed.meta == whole.meta, f.name
    assert load_trace(path).spans == kineto_to_trace(read_json(path), source=str(path)).spans
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"traceEvents": gpu_run_events(), "schemaVersion": 1}))  # opens with traceEvents
    assert stream_kineto(other) is None and load_trace(other).meta["format"] == "kineto-json"  # read whole
