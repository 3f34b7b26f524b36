"""Our binary columns (`.npz`, traces.formats.npz): a trace reads back span for span, its steps are found on the
columns exactly as on the spans (so `--steps` makes spans for those steps only), every command gives the same
answer from .npz as from JSON, and a damaged or forged file is refused in one line naming the column."""
from __future__ import annotations

import json
import pickle
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from mhcpipe.cli import main
from schedules import build, simulate
from traces.analysis.matching import drop_warmup_step, key_groups
from traces.analysis.step_keys import KEY_IDS, file_step_index, step_arrays
from traces.analysis.step_select import file_trace, select_file_steps, select_steps, steps_of
from traces.formats.io import load_trace
from traces.formats.npz import ColumnFile, save_npz
from traces.columns import columns_of
from traces.trace import Span, Trace, TraceError, has_kept
from traces_testlib import shared_traces  # noqa: F401  (fixture)

DATA = Path(__file__).parent / "data"
OURS = ["measured_dualpipev_tiny.json.gz", "measured_emulated_pp2_dp2.json.gz", "predicted_dualpipev_tiny.json.gz"]


def _run(steps: int = 5, shuffled: bool = False) -> Trace:
    """A measured-looking run: one simulated DualPipeV step repeated, each a little slower, with kernel-part spans
    whose name is empty (their label, hence span_key's part, follows from the other fields: the same op's part on
    the compute and the hp stream are two keys) and comm fields; `shuffled`: the spans in no time order."""
    one = simulate(build("dualpipev", 2, 4)).trace
    length = max(s.end for s in one.spans) * 1.05
    spans = []
    for k in range(steps):
        for s in one.spans:
            spans.append(replace(s, start=s.start * (1 + 0.01 * k) + k * length, duration=s.duration * (1 + 0.01 * k),
                                 group="p2p" if s.stream == "comm" else None, batch=k if s.stream == "comm" else None))
            if s.kind == "F":
                spans.append(replace(spans[-1], kind="F.post_res", duration=s.duration / 4))
                spans.append(replace(spans[-1], stream="hp", start=spans[-1].start + s.duration / 2))
    if shuffled:
        spans = [spans[i] for i in np.random.default_rng(0).permutation(len(spans))]
    return Trace(spans=spans, meta={**one.meta, "source": "measured"})


def _check_steps(trace: Trace, path: Path) -> None:
    """The steps as arrays, from the spans, from key_groups' dict where the trace keeps it and from the file's
    columns, are key_groups' instance numbers; the warm-up drop's arrays are those of the trace it leaves; cuts of
    steps from the file equal the cuts of the trace."""
    fresh = Trace(list(trace.spans), trace.meta)  # nothing kept on it: its arrays come from the spans
    want = {i: k for idx in key_groups(trace).values() for k, i in enumerate(idx)}
    save_npz(trace, path)
    cf = ColumnFile.read(path)
    for rows, steps in (file_step_index(cf), step_arrays(trace), step_arrays(fresh)):
        assert dict(zip(rows.tolist(), steps.tolist())) == want
        assert (rows[1:] > rows[:-1]).all()
    dropped = drop_warmup_step(trace)
    if dropped is not trace:
        fresh = Trace(list(dropped.spans), dropped.meta)
        for got, new in zip(step_arrays(dropped), step_arrays(fresh)):
            assert got.tolist() == new.tolist()
    have = steps_of(trace).steps
    for a, b in ((have[0], have[0]), (have[0], have[-1]), (have[len(have) // 2], have[-1])):
        want, got = select_steps(trace, a, b), select_file_steps(cf, a, b)
        assert got.spans == want.spans and got.meta == want.meta, (a, b)
        _same_columns(got)
        _same_key_groups(got)
    _same_columns(cf.trace())
    whole = file_trace(cf)
    _same_key_groups(whole)
    _same_key_groups(drop_warmup_step(whole))


def _same_key_groups(trace: Trace) -> None:
    """A trace read from .npz (whole, a step range, its warm-up dropped) keeps its key ids from the file's columns:
    key_groups on them are those its spans make, keys and indices in the same order."""
    assert has_kept(trace, KEY_IDS)
    got = [(k, v.tolist()) for k, v in key_groups(trace).items()]
    assert got == [(k, v.tolist()) for k, v in key_groups(Trace(list(trace.spans), trace.meta)).items()]


def _same_columns(trace: Trace) -> None:
    """A trace read from .npz keeps the file's columns (codes numbered again): the columns its spans make."""
    assert has_kept(trace, "_columns")
    got, want = columns_of(trace), columns_of(Trace(list(trace.spans), trace.meta))
    for f in ("rank", "start", "duration", "kind", "stream"):
        a, b = getattr(got, f), getattr(want, f)
        assert a.dtype == b.dtype and np.array_equal(a, b), f
    assert got.kinds == want.kinds and got.streams == want.streams


@pytest.mark.parametrize("name", OURS)
def test_our_traces_read_back_span_for_span_and_their_steps_match(tmp_path, name):
    trace = load_trace(DATA / name)
    out = save_npz(trace, tmp_path / "t.npz")
    back = load_trace(out)
    assert back.spans == trace.spans and back.meta == json.loads(json.dumps(trace.meta))
    _check_steps(trace, tmp_path / "s.npz")


@pytest.mark.parametrize("shuffled", [False, True])
def test_steps_of_unnamed_kernel_parts_and_comm_fields_match(tmp_path, shuffled):
    """Also with the file's order not the time order: a key's instances are its steps in start order."""
    trace = _run(shuffled=shuffled)
    assert any(s.kind == "F.post_res" and not s.name for s in trace.spans)
    back = load_trace(save_npz(trace, tmp_path / "r.npz"))
    assert back.spans == trace.spans
    _check_steps(trace, tmp_path / "s.npz")


def test_third_party_traces_read_back_span_for_span(shared_traces, tmp_path):  # noqa: F811
    names = [p.name for p in sorted(shared_traces.iterdir()) if p.name != "SOURCES.md"]
    assert names
    for name in names:
        trace = load_trace(shared_traces / name)
        back = load_trace(save_npz(trace, tmp_path / f"{name}.npz"))
        assert back.spans == trace.spans and back.meta == json.loads(json.dumps(trace.meta)), name


def _cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_every_command_answers_the_same_from_npz(tmp_path, capsys):
    """critical-path, whatif, overlap and compare, whole and with --steps (read from the columns), give the JSON
    file's answers; convert writes .npz and cuts steps from it."""
    src = _run().save(tmp_path / "run.json")
    npz = tmp_path / "run.npz"
    rc, out, _ = _cli(capsys, "convert", str(src), "-o", str(npz))
    assert rc == 0 and "binary columns" in out
    pred = simulate(build("dualpipev", 2, 4)).trace
    pred.meta["source"] = "predicted"
    pred_file = pred.save(tmp_path / "pred.json")
    runs = [("critical-path",), ("whatif", "--scale", "F=0.5"), ("overlap",), ("compare", str(pred_file))]
    for cmd, *extra in runs:
        for steps in ((), ("--steps", "1..3")):
            outs = []
            for f in (src, npz):
                j = tmp_path / f"{cmd}_{f.suffix}.json"
                args = [cmd, *extra, str(f)] if cmd == "compare" else [cmd, str(f), *extra]
                assert _cli(capsys, *args, *steps, "--json", str(j))[0] == 0, (cmd, f)
                outs.append(json.loads(j.read_text()))
            assert outs[0] == outs[1], (cmd, steps)
    cut = tmp_path / "cut.npz"
    rc, out, _ = _cli(capsys, "convert", str(npz), "-o", str(cut), "--steps", "2..3")
    assert rc == 0 and "steps 2..3" in out
    want = select_steps(load_trace(src), 2, 3)
    got = load_trace(cut)
    assert got.spans == want.spans and got.meta == want.meta
    rc, _, err = _cli(capsys, "whatif", str(npz), "--scale", "F=0.5", "--steps", "3..9")
    assert rc == 2 and "step 5 is not among them" in err and len(err.strip().splitlines()) == 1
    rc, _, err = _cli(capsys, "convert", str(npz), "-o", str(tmp_path / "x.parquet"))
    assert rc == 2 and "write .json" in err and len(err.strip().splitlines()) == 1


def _arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _forge(path: Path, change) -> Path:
    cols = _arrays(path)
    change(cols)
    out = path.with_name("forged.npz")
    with out.open("wb") as fh:
        np.savez(fh, **cols)
    return out


def _set(name, value):
    def change(cols):
        cols[name] = value(cols) if callable(value) else value
    return change


FORGERIES = [
    ("a pickled column", _set("rank", lambda c: np.array([object()] * len(c["rank"]), dtype=object)),
     "column rank: cannot be read as plain data"),
    ("a missing column", lambda c: c.pop("start"), "column 'start' is missing"),
    ("an unknown column", _set("evil", np.zeros(3)), "unknown column 'evil'"),
    ("floats as ranks", _set("rank", lambda c: c["rank"].astype(float)), "column rank: dtype float64"),
    ("a code naming no value", _set("kind_codes", lambda c: c["kind_codes"] + 99), "column kind_codes: a code"),
    ("a negative duration", _set("duration", lambda c: -c["duration"]), "column duration: a value that is negative"),
    ("a short column", _set("start", lambda c: c["start"][:-1]), "column start: shape"),
    ("a negative rank", _set("rank", lambda c: c["rank"] - 5), "column rank: a value below 0"),
    ("metadata that is not JSON", _set("meta", np.array("{nope")), "column meta"),
    ("another format", _set("format", np.array("other")), "column format: expected 'mhc-pipe-trace'"),
    ("a newer version", _set("version", np.array(7)), "version 7 is not supported"),
    ("codes without values", lambda c: c.pop("kind_values"), "column 'kind_values' is missing"),
]


@pytest.mark.parametrize("what, change, message", FORGERIES, ids=[f[0] for f in FORGERIES])
def test_a_damaged_or_forged_file_is_refused_in_one_line(tmp_path, capsys, what, change, message):
    good = save_npz(_run(2), tmp_path / "good.npz")
    bad = _forge(good, change)
    with pytest.raises(TraceError, match="^" + str(bad)):
        ColumnFile.read(bad)
    rc, _, err = _cli(capsys, "overlap", str(bad))
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_pickle_in_the_archive_never_runs(tmp_path, capsys):
    """np.load(allow_pickle=False) refuses object arrays: a payload that would run code on unpickling stays data."""
    ran = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (ran,))

    good = save_npz(_run(2), tmp_path / "good.npz")
    cols = _arrays(good)
    cols["meta"] = np.array([Payload()], dtype=object)
    bad = tmp_path / "evil.npz"
    with bad.open("wb") as fh:
        np.savez(fh, **cols)
    assert pickle.dumps(Payload())  # the payload is a real pickle
    rc, _, err = _cli(capsys, "critical-path", str(bad))
    assert rc == 2 and "column meta: cannot be read as plain data" in err and not ran.exists()
    truncated = tmp_path / "cut.npz"
    truncated.write_bytes(good.read_bytes()[:200])
    rc, _, err = _cli(capsys, "critical-path", str(truncated))
    assert rc == 2 and "not a readable .npz trace" in err and len(err.strip().splitlines()) == 1


def test_spans_are_made_only_for_the_steps_asked_for(tmp_path, monkeypatch):
    """select_file_steps builds Span objects for the kept rows only, and only when asked for (what keeps a
    10^7-span file's steps A..B in the memory of those steps)."""
    trace = _run()
    cf = ColumnFile.read(save_npz(trace, tmp_path / "r.npz"))
    made = []
    import traces.formats.npz as npz

    class Counting(Span):
        __slots__ = ()

        def __init__(self, *a):
            made.append(1)
            super().__init__(*a)

    monkeypatch.setattr(npz, "Span", Counting)
    cut = select_file_steps(cf, 1, 1)
    assert not made and not cut.spans_made  # made when first asked for
    n = len(cut.spans)
    assert 0 < len(made) == n < len(trace.spans) / 4


def test_a_negative_stage_is_refused_when_written(tmp_path):
    """-1 means none in the file: a span with stage -1 would read back without a stage, so writing it is refused."""
    bad = Trace([Span(0, "compute", "F", -1, 0, 0.0, 1.0)], {})
    with pytest.raises(TraceError, match="field stage: a negative value"):
        save_npz(bad, tmp_path / "neg.npz")
