"""A run folder is read whatever else it holds (issue 34 item 3): `--trace-dir` writes rank<N>.json, the merged
trace.json and, with --diagnostics-every, diagnostics_rank<N>.json; a Flight Recorder ledger may sit there too."""
import json

import pytest

from mhcpipe.cli import main
from traces.formats.io import TraceError, load_trace
from traces.trace import Span, Trace

META = {"source": "measured", "time_unit": "us", "schedule": {"kind": "1f1b", "ranks": 2, "microbatches": 1}}


def _rank(r: int) -> Trace:
    return Trace([Span(r, "compute", "F", r, 0, 10.0 * r, 5.0), Span(r, "compute", "B", r, 0, 30.0 - 10 * r, 5.0)],
                 dict(META))


def test_a_run_folder_reads_its_merged_trace_and_skips_other_json(tmp_path):
    for r in (0, 1):
        _rank(r).save(tmp_path / f"rank{r}.json")
        (tmp_path / f"diagnostics_rank{r}.json").write_text(json.dumps({"steps": [], "rank": r}))
    merged = Trace(_rank(0).spans + _rank(1).spans, dict(META))
    merged.save(tmp_path / "trace.json")
    t = load_trace(tmp_path)
    assert t.ranks == [0, 1] and len(t.spans) == 4  # the merged trace once, not its ranks twice
    assert sorted(t.meta["skipped"]) == ["diagnostics_rank0.json", "diagnostics_rank1.json", "rank0.json",
                                         "rank1.json"]
    (tmp_path / "trace.json").unlink()  # per-rank files only: merged by rank, the diagnostics skipped
    t = load_trace(tmp_path)
    assert t.ranks == [0, 1] and len(t.spans) == 4 and t.meta["skipped"] == ["diagnostics_rank0.json",
                                                                             "diagnostics_rank1.json"]


def test_a_file_named_like_a_ranks_trace_that_is_none_is_an_error(tmp_path, capsys):
    _rank(0).save(tmp_path / "rank0.json")
    (tmp_path / "rank1.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(TraceError, match=r"rank1\.json: JSON of unknown shape"):
        load_trace(tmp_path)
    assert main(["view", str(tmp_path), "-o", str(tmp_path / "v.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "rank1.json: JSON of unknown shape" in err


def test_a_folder_of_non_traces_says_so(tmp_path):
    (tmp_path / "diagnostics_rank0.json").write_text("{}")
    with pytest.raises(TraceError, match=r"no trace files .*diagnostics_rank0\.json are not traces"):
        load_trace(tmp_path)
