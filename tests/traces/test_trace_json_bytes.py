"""Our JSON version 2 read in one pass (traces.trace_json.validated_v2_bytes: pydantic parses and checks the bytes
together) gives what the general path gives (json.loads, then the schema check): the same columns from the suite's
traces, the same values for what JSON writes oddly (NaN, numbers as strings, duplicate keys), and a file that fails
the one-pass check is read again the general way, whose error names the field."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import traces.formats.io as io
from traces.formats.io import load_trace, read_columns
from traces.formats.npz import ColumnFile
from traces.trace import TraceError
from traces.trace_json import _COLUMN_FILE, opens_as_v2, validated_v2_bytes

DATA = Path(__file__).parent / "data"
NAMES = ["measured_dualpipev_tiny.json.gz", "measured_emulated_pp2_dp2.json.gz", "predicted_dualpipev_tiny.json.gz"]


def _arrays(cf: ColumnFile) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in cf.cols.items()}


@pytest.mark.parametrize("name", NAMES)
def test_one_pass_columns_equal_the_general_paths(tmp_path, monkeypatch, name):
    whole = load_trace(DATA / name)
    written = whole.save(tmp_path / "t.json")
    assert io._plain_v2(written)  # as our writer writes it: the one-pass path is taken
    fast = read_columns(written)
    monkeypatch.setattr(io, "ONE_PASS_MAX_BYTES", 0)  # the same file the general way
    assert not io._plain_v2(written)
    slow = read_columns(written)
    assert isinstance(fast, ColumnFile) and isinstance(slow, ColumnFile)
    a, b = _arrays(fast), _arrays(slow)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k
    assert fast.meta == slow.meta == whole.meta and fast.meta
    assert int(fast.cols["partner_set"].sum()) > 0 or "predicted" not in name  # the F&B pairs' partners are read


ODD = {
    "nan start": '"start": [NaN, 2.5]',
    "number as string": '"start": ["1.5", 2]',
    "bool as number": '"start": [true, 2.0]',
    "huge integer": '"start": [1' + "0" * 30 + ', 2.0]',
    "infinity": '"start": [Infinity, 1e400]',
    "duplicate key": '"start": [9.0, 9.0], "start": [1.0, 2.0]',
}


def _doc(start: str, partner: str = '[null, [1, 0]]') -> str:
    return ('{"format": "mhc-pipe-trace", "version": 2, "meta": {"source": "measured"}, "columns": {"rank": [0, 1], '
            '"stream": {"values": ["compute"], "codes": [0, 0]}, "kind": {"values": ["F", "FB"], "codes": [0, 1]}, '
            f'{start}, "duration": [1.0, 2.0], "partner": {partner}}}}}')


@pytest.mark.parametrize("what", sorted(ODD))
def test_what_json_writes_oddly_parses_to_the_same_values(what):
    text = _doc(ODD[what])
    fast = validated_v2_bytes(text.encode())
    general = _COLUMN_FILE.validate_python(json.loads(text))
    assert fast is not None
    assert repr(fast) == repr(general)  # repr: NaN equals itself there


def test_a_file_off_its_schema_fails_in_one_line_naming_the_field(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(_doc('"start": ["soon", 2.0]'))
    assert io._plain_v2(bad) and validated_v2_bytes(bad.read_bytes()) is None
    with pytest.raises(TraceError, match=r"bad.json: field columns.start.0: .*number"):
        read_columns(bad)
    cut = tmp_path / "cut.json"
    cut.write_text(_doc('"start": [1.0, 2.0]')[:-40])
    with pytest.raises(TraceError, match=r"cut.json: not valid JSON"):
        read_columns(cut)


def test_only_our_writers_opening_takes_the_one_pass_path(tmp_path):
    assert opens_as_v2(_doc('"start": [1.0, 2.0]').encode())
    assert not opens_as_v2(b'{"version": 2, "format": "mhc-pipe-trace"}')
    assert not opens_as_v2(b'{"format": "mhc-pipe-trace", "version": 1, "spans": []}')
    assert not opens_as_v2(b'{"format": "mhc-pipe-trace", "version": 20}')
    reordered = tmp_path / "reordered.json"  # another writer's key order: read the general way, to the same columns
    doc = json.loads(_doc('"start": [1.0, 2.0]'))
    reordered.write_text(json.dumps({"columns": doc["columns"], "version": 2, "format": "mhc-pipe-trace",
                                     "meta": doc["meta"]}))
    ours = tmp_path / "ours.json"
    ours.write_text(json.dumps(doc))
    assert not io._plain_v2(reordered) and io._plain_v2(ours)
    a, b = _arrays(read_columns(reordered)), _arrays(read_columns(ours))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert b["partner"].tolist() == [[0, 0], [1, 0]] and b["partner_set"].tolist() == [False, True]
