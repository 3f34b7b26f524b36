"""The critical path, the what-if replay and the path's pictures on real measured traces: the runtime trains the
tiny DualPipeV model with mHC (n = 4) and the baseline, one step of each in turn, on 4 gloo ranks (3 steps, the
warm-up dropped) - the demo's setting at test size (about 30 s on 2 cores).

* Every step: the replay of the recorded durations reproduces the recorded makespan, and the path's length plus
  its gaps (the recorded delays between its ops) is the makespan; the schedule's data edges all hold in the
  recorded times.
* Removing an op off the path leaves the step; halving one on the path shortens it.
* whatif mhc=0 against the baseline run moves the mHC step toward the baseline's.
* compare: both critical paths, and mHC's overhead along them adds up to the overhead.
* view: PNG, HTML and Perfetto JSON carry the path.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipeline"))

from _pipeline_helpers import check_ok, tiny_config
from mhcpipe.cli import main
from pipeline.launch.local import interleaved_worker
from rank_pool import launch
from traces.formats.chrome import validate_chrome
from traces.analysis.compare import compare
from traces.analysis.critical_path import critical_path
from traces.analysis.matching import drop_warmup_step
from traces.drawing.path_marks import paths_for, place
from traces.analysis.replay import critical_chain, measured_durations, replay, slack
from traces.analysis.span_graph import build_span_graph
from traces.analysis.step_select import steps_of
from traces.trace import Trace
from traces.drawing.view import build_layout
from traces.analysis.whatif import whatif

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("measured")
    cfgs = [tiny_config("dualpipev", 4, n=n, steps=3, timeout_s=60) for n in (4, 1)]
    dirs = [str(root / "mhc"), str(root / "base")]
    check_ok(launch(interleaved_worker, 4, (cfgs, dirs), timeout_s=280))
    return {name: drop_warmup_step(Trace.load(root / name / "trace.json")) for name in ("mhc", "base")} | \
        {"root": root}


def test_replay_reproduces_every_step_and_length_plus_gaps_is_the_makespan(runs):
    for name in ("mhc", "base"):
        t = runs[name]
        assert t.meta["p2p_completion"] == "at the wait" and t.meta["wait_spans"]
        for k in steps_of(t).steps:
            g = build_span_graph(t, step=k)
            assert not [v for v in g.violations if "(data)" in v], g.violations
            tm = replay(g)
            assert abs(tm.makespan - g.makespan) <= 1e-9 * g.makespan
            assert np.allclose(tm.start, [n.start for n in g.nodes], rtol=0, atol=1e-9 * g.makespan)
            cp = critical_path(t, step=k)
            assert abs(cp.length_us + cp.gaps_us - cp.makespan_us) <= 1e-9 * cp.makespan_us
            assert 0.3 * cp.makespan_us < cp.length_us <= cp.makespan_us
            assert len({p.rank for p in cp.path}) >= 2  # the chain crosses ranks


def test_off_path_removal_keeps_the_step_on_path_halving_shortens_it(runs):
    g = build_span_graph(runs["mhc"])
    tm = replay(g)
    on = set(critical_chain(tm).nodes)
    sl = slack(tm)
    off = [v for v in range(len(g.nodes)) if v not in on and sl[v] > 1.0 and g.nodes[v].duration > 0]
    heavy_on = sorted(on, key=lambda v: -g.nodes[v].duration)[:5]
    assert off and heavy_on
    for v in off[:10]:
        d = measured_durations(g)
        d[v] = 0.0
        assert abs(replay(g, d).makespan - tm.makespan) <= 1e-9 * tm.makespan
    for v in heavy_on:
        d = measured_durations(g)
        d[v] *= 0.5
        assert replay(g, d).makespan < tm.makespan - 1e-9 * tm.makespan, g.nodes[v].label


def test_whatif_mhc_zero_moves_the_mhc_step_toward_the_baseline(runs):
    m, b = runs["mhc"], runs["base"]
    w = whatif(m, {"mhc": 0.0}, baseline=b)
    base_step = whatif(b, {}).measured_step_us
    assert w.reproduction_error_pct < 1e-7
    assert abs(w.step_us - base_step) < 0.6 * abs(w.measured_step_us - base_step)
    assert w.after.length_us < w.before.length_us


def test_compare_reports_both_paths_and_the_overhead_along_them(runs):
    pred = critical_path(runs["mhc"])  # a comparison of two measured traces, as a prediction and a measurement
    assert pred.path
    c = compare(runs["mhc"], runs["mhc"], baseline=(runs["base"], runs["base"]))
    cp = c.critical_path
    assert cp["meas"]["length_us"] > 0 and cp["pred"]["makespan_us"] == cp["meas"]["makespan_us"]
    ov = cp["overhead_on_path"]["meas"]
    assert abs(sum(ov["causes_us"].values()) - ov["overhead_us"]) <= 1e-6 * abs(ov["overhead_us"])
    assert ov["causes_us"]["mhc_kernels"] > 0


def test_view_outlines_the_path_in_png_html_and_perfetto(runs, tmp_path, capsys):
    src = runs["root"] / "mhc" / "trace.json"
    t = runs["mhc"]
    lay = build_layout([t], ["meas"])
    paths, notes = paths_for([t])
    marks = place(paths, lay.cell_of, lay.origins)
    assert not notes and len(marks) == len(paths[0].path)
    for suffix in ("png", "html", "json"):
        assert main(["view", str(src), "-o", str(tmp_path / f"v.{suffix}")]) == 0
    html = (tmp_path / "v.html").read_text()
    assert '"crit":[[0,' in html and "critical path" in html
    data = json.loads((tmp_path / "v.json").read_text())
    assert not validate_chrome(data)
    crit = [e for e in data["traceEvents"] if e.get("cat") == "critical_path" and e["ph"] == "X"]
    # the view draws one step, the median after the warm-up (mhcpipe view --step), and outlines that step's path
    from mhcpipe.trace_cli import one_step

    assert len(crit) == len(critical_path(one_step(Trace.load(src), None)).path)
    assert main(["view", str(src), "-o", str(tmp_path / "w.json"), "--no-critical-path"]) == 0
    plain = json.loads((tmp_path / "w.json").read_text())["traceEvents"]
    assert not any(e.get("cat") == "critical_path" for e in plain)


def test_view_draws_one_steady_step_titled_by_the_run_in_ms(runs, tmp_path, capsys):
    """Issue 34: a measured run's picture shows one step (the median after the warm-up) unless --step says
    otherwise, is titled by the run (model, schedule, layout, residual, step), ticks in ms without an offset,
    and names every mark in its legends (F&B pair frames, idle; no internal span kinds)."""
    from matplotlib.ticker import FuncFormatter

    from mhcpipe.trace_cli import one_step
    from traces.drawing.view import describe_run, render_figure

    src = runs["root"] / "mhc" / "trace.json"
    full = Trace.load(src)
    one = one_step(full, None)
    steps = {s for s in one.spans if s.kind == "step"}
    assert not steps and 0 < len(one.spans) < len(full.spans) / 2
    assert one.meta["steps"] == 2 and one.meta["step"] in (0, 1)  # 3 steps, the warm-up dropped
    title = describe_run(one)
    assert title.startswith("test, dualpipev PP4, M=8") and "mhc n=4" in title and "after the warm-up" in title
    for argv, ok in ((["--step", "1"], 0), (["--step", "all"], 0), (["--step", "7"], 2), (["--step", "x"], 2)):
        assert main(["view", str(src), "-o", str(tmp_path / "v.png"), *argv]) == ok
        cap = capsys.readouterr()
        assert ok == 0 or (len(cap.err.strip().splitlines()) == 1 and "--step" in cap.err), cap.err
    fig = render_figure([one], ["meas"], title=title)
    ax, bars = fig.axes[0], fig.axes[1]
    assert isinstance(ax.xaxis.get_major_formatter(), FuncFormatter) and "(ms)" in ax.get_xlabel()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "F&B pair (overlapped)" in labels and "idle (compute row empty)" in labels
    assert "darker: 2nd chunk / direction (F, I, B, W)" in labels  # DualPipeV: the V's way back in its own tones
    kinds = [t.get_text() for t in bars.get_legend().get_texts()]
    assert not [k for k in kinds if "." in k] and "F&B pair" in kinds
