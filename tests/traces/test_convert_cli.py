"""`mhcpipe convert`: a trace of any format written as our JSON (version 2) reads back with the same spans, and a
cut of some steps analyses as those steps of the whole run did (the warm-up is not dropped twice)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from mhcpipe.cli import main
from schedules import build, simulate
from traces.formats.io import load_trace
from traces.trace import Trace
from traces_testlib import shared_traces  # noqa: F401  (fixture)


def _run(steps: int = 5) -> Trace:
    """A measured-looking run: one simulated DualPipeV step repeated, each step a little slower than the last."""
    one = simulate(build("dualpipev", 2, 4)).trace
    length = max(s.end for s in one.spans) * 1.05
    spans = [replace(s, start=s.start * (1 + 0.01 * k) + k * length, duration=s.duration * (1 + 0.01 * k))
             for k in range(steps) for s in one.spans]
    return Trace(spans=spans, meta={**one.meta, "source": "measured"})


def _cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_a_cut_of_steps_analyses_as_those_steps_of_the_run(tmp_path, capsys):
    src = _run().save(tmp_path / "run.json")
    cut = tmp_path / "cut.json"
    rc, out, _ = _cli(capsys, "convert", str(src), "-o", str(cut), "--steps", "2..3")
    assert rc == 0 and "steps 2..3" in out
    whole, part = tmp_path / "whole_cp.json", tmp_path / "part_cp.json"
    # the run's steps after its warm-up: 0..3 = the file's 1..4; the cut's 0..1 = the file's 2..3
    assert _cli(capsys, "critical-path", str(src), "--step", "1", "--json", str(whole))[0] == 0
    assert _cli(capsys, "critical-path", str(cut), "--step", "0", "--json", str(part))[0] == 0
    a, b = json.loads(whole.read_text()), json.loads(part.read_text())
    assert b["steps"] == 2 and a["steps"] == 4
    for key in ("makespan_us", "length_us", "by_kind", "path", "exposed_comm_us"):
        assert a[key] == b[key], key
    assert Trace.load(cut).meta["first_step"] == 2


@pytest.mark.parametrize("steps, message", [
    ("3..1", "the last step 1 comes before the first 3"),
    ("x", "write A..B"),
    ("4..9", "the trace holds steps 0..4"),
])
def test_bad_steps_are_refused_in_one_line(tmp_path, capsys, steps, message):
    src = _run().save(tmp_path / "run.json")
    rc, _, err = _cli(capsys, "convert", str(src), "-o", str(tmp_path / "o.json"), "--steps", steps)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["hta_step_based_trace_2543932.json.gz",
                                  "pipit_saxpy-mpi-cuda_nsys_perlmutter0.sqlite"])
def test_a_third_party_trace_converts_span_for_span(shared_traces, tmp_path, capsys, name):  # noqa: F811
    out = tmp_path / "c.json"
    assert _cli(capsys, "convert", str(shared_traces / name), "-o", str(out))[0] == 0
    original, converted = load_trace(shared_traces / name), Trace.load(out)
    assert converted.spans == original.spans and converted.meta == json.loads(json.dumps(original.meta))


def test_steps_on_the_analyses_equal_the_analyses_of_the_cut(tmp_path, capsys):
    """`--steps A..B` on critical-path, whatif, overlap and compare: the analysis of a convert --steps cut, without
    writing it; a range the trace does not hold, or a malformed one, is refused in one line."""
    src = _run().save(tmp_path / "run.json")
    cut = tmp_path / "cut.json"
    assert _cli(capsys, "convert", str(src), "-o", str(cut), "--steps", "1..3")[0] == 0
    pred = simulate(build("dualpipev", 2, 4)).trace
    pred.meta["source"] = "predicted"
    pred_file = pred.save(tmp_path / "pred.json")
    for cmd, extra in (("critical-path", ()), ("whatif", ("--scale", "F=0.5")), ("overlap", ())):
        a, b = tmp_path / f"{cmd}_steps.json", tmp_path / f"{cmd}_cut.json"
        assert _cli(capsys, cmd, str(src), *extra, "--steps", "1..3", "--json", str(a))[0] == 0
        assert _cli(capsys, cmd, str(cut), *extra, "--json", str(b))[0] == 0
        assert json.loads(a.read_text()) == json.loads(b.read_text()), cmd
    a, b = tmp_path / "cmp_steps.json", tmp_path / "cmp_cut.json"
    assert _cli(capsys, "compare", str(pred_file), str(src), "--steps", "1..3", "--json", str(a))[0] == 0
    assert _cli(capsys, "compare", str(pred_file), str(cut), "--json", str(b))[0] == 0
    got, want = json.loads(a.read_text()), json.loads(b.read_text())
    assert got["steps"] == want["steps"] == 3 and got["makespan_meas_us"] == want["makespan_meas_us"]
    rc, _, err = _cli(capsys, "whatif", str(src), "--scale", "F=0.5", "--steps", "3..9")
    assert rc == 2 and "step 5 is not among them" in err and len(err.strip().splitlines()) == 1
    rc, _, err = _cli(capsys, "overlap", str(src), "--steps", "2..x")
    assert rc == 2 and "write A..B" in err and len(err.strip().splitlines()) == 1
