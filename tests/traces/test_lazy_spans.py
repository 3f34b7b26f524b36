"""A trace read from our .npz columns makes its Span objects only when `spans` is first asked for (traces.trace.Trace
.of_rows): its fields, labels, cuts and kept values answer from the columns exactly as the Spans would, and
`mhcpipe compare` of two such traces never makes them (10^6 spans: 5.1 -> 3.3 s, 0.73 -> 0.46 GB). Our JSON
(version 2) is read into the same columns (traces.formats.npz.ColumnFile.of_json)."""
from __future__ import annotations

from pathlib import Path

import pytest

from traces.analysis.compare import compare
from traces.analysis.matching import drop_warmup_step
from traces.analysis.step_select import file_trace
from traces.columns import columns_of
from traces.formats.io import load_trace, read_columns
from traces.formats.npz import ColumnFile, save_npz
from traces.trace import SPAN_FIELDS, Span, Trace

DATA = Path(__file__).parent / "data"
MEASURED = DATA / "measured_dualpipev_tiny.json.gz"
PREDICTED = DATA / "predicted_dualpipev_tiny.json.gz"


def _lazy(trace: Trace, path: Path, how: str = "npz") -> Trace:
    """`trace` written as our .npz or JSON and read back as the commands read them (traces.formats.io.read_columns)."""
    written = save_npz(trace, path.with_suffix(".npz")) if how == "npz" else trace.save(path.with_suffix(".json"))
    read = read_columns(written)
    assert isinstance(read, ColumnFile)
    return file_trace(read)


@pytest.mark.parametrize("how", ["npz", "json"])
@pytest.mark.parametrize("name", ["measured_dualpipev_tiny.json.gz", "measured_emulated_pp2_dp2.json.gz",
                                  "predicted_dualpipev_tiny.json.gz"])
def test_fields_labels_and_cuts_answer_as_the_spans_would(tmp_path, name, how):
    whole = load_trace(DATA / name)
    lazy = _lazy(whole, tmp_path / "t", how)
    assert not lazy.spans_made and lazy.span_count == len(whole.spans)
    n = len(whole.spans)
    idx = list(range(n - 1, -1, -3))  # out of order, some rows only
    for f in SPAN_FIELDS:
        assert lazy.field(f) == [getattr(s, f) for s in whole.spans], f
        assert lazy.field(f, idx) == [getattr(whole.spans[i], f) for i in idx], f
        is_set = [getattr(whole.spans[i], f) is not None for i in idx]
        assert lazy.known(f, idx).tolist() == is_set == whole.known(f, idx).tolist(), f
        if f in ("rank", "stage", "mb", "peer", "batch"):
            ints = [-1 if getattr(whole.spans[i], f) is None else getattr(whole.spans[i], f) for i in idx]
            assert lazy.ints(f, idx).tolist() == ints == whole.ints(f, idx).tolist(), f
    assert lazy.labels(idx) == [whole.spans[i].label for i in idx]
    assert lazy.spans_at(idx) == [whole.spans[i] for i in idx]
    assert lazy.span(idx[0]) == whole.spans[idx[0]]
    assert lazy.ranks == whole.ranks
    cut = lazy.subset(idx, {"cut": True})
    assert not cut.spans_made and cut.meta == {"cut": True}
    assert cut.spans == [whole.spans[i] for i in idx]
    assert not lazy.spans_made  # none of the above made them
    assert lazy == whole and lazy.spans_made


def test_what_was_kept_for_the_rows_is_kept_for_their_spans(tmp_path):
    """columns_of's arrays kept before the Span objects exist are the same object after (no second pass), and a
    changed span list still drops them (traces.trace.kept)."""
    lazy = _lazy(load_trace(MEASURED), tmp_path / "t")
    cols = columns_of(lazy)
    spans = lazy.spans
    assert columns_of(lazy) is cols
    lazy.spans = spans[: len(spans) // 2]
    assert len(columns_of(lazy)) == len(spans) // 2


@pytest.mark.parametrize("how", ["npz", "json"])
def test_compare_of_column_read_traces_makes_no_span_objects(tmp_path, how):
    """compare on columns: the measured run (WAIT spans, F&B halves, kernel parts) and the prediction, both read as
    columns, give the comparison their Span-holding twins give, and neither makes its Span objects."""
    pred, meas = load_trace(PREDICTED), drop_warmup_step(load_trace(MEASURED))
    lazy_pred = _lazy(pred, tmp_path / "p", how)
    lazy_meas = drop_warmup_step(_lazy(load_trace(MEASURED), tmp_path / "m", how))
    assert not lazy_meas.spans_made
    got = compare(lazy_pred, lazy_meas).to_dict()
    assert not lazy_pred.spans_made and not lazy_meas.spans_made
    assert got == compare(pred, meas).to_dict()


def test_a_span_list_given_is_the_trace_s():
    spans = [Span(0, "compute", "F", 0, 0, 0.0, 1.0)]
    t = Trace(spans, {})
    assert t.spans is spans and t.spans_made and t.field("kind") == ["F"] and t.labels([0]) == ["F/s0/mb0"]
