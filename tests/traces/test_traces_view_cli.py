"""`mhcpipe view` / `mhcpipe compare` end to end (through mhcpipe.cli's error handling), the pictures, and a
10^4-span render (the time at 10^5 spans: bench/trace_scale.py)."""
from __future__ import annotations

import json
import re

import pytest
from matplotlib.image import imread

import mhcpipe.cli as cli
from traces.formats.chrome import validate_chrome
from traces.formats.io import load_trace
from traces.drawing.html_view import write_html
from traces.drawing.view import build_layout, write_picture
from traces_testlib import one_f_one_b, shared_traces  # noqa: F401


@pytest.fixture
def mhcpipe(monkeypatch, capsys):
    """Run `mhcpipe ARGS` in this process (the CLI registers the named command's module only)."""

    def run(*args: str) -> tuple[int, str, str]:
        rc = cli.main([str(a) for a in args])
        out = capsys.readouterr()
        return rc, out.out, out.err
    return run


@pytest.fixture
def pair(tmp_path):
    pred = one_f_one_b(4, 6)
    meas = one_f_one_b(4, 6, f=lambda r, m: 11 + (m % 2), b=lambda r, m: 19 + r, comm=1.5, source="measured",
                       steps=2, origin=1e6)
    return pred.save(tmp_path / "pred.json"), meas.save(tmp_path / "meas.json")


def test_view_png_svg_html_json(mhcpipe, pair, tmp_path):
    pred, meas = pair
    for ext in ("png", "svg", "html", "json"):
        rc, out, err = mhcpipe("view", meas, "--predicted", pred, "-o", tmp_path / f"v.{ext}")
        assert rc == 0 and err == "" and f"v.{ext}" in out
    img = imread(tmp_path / "v.png")
    assert img.shape[0] > 400 and img.shape[1] > 1000
    svg = (tmp_path / "v.svg").read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    html = (tmp_path / "v.html").read_text()
    assert "<canvas" in html and not re.search(r"<script[^>]+src=|<link[^>]+href=|https?://[^\"']*\.js", html)
    data = json.loads(re.search(r"const D=(\{.*?\});\n", html).group(1))
    labels = [r["label"] for r in data["rows"]]
    assert labels[0] == "pred r0 compute" and labels[-1] == "meas r3 comm"  # predicted rows above measured
    assert "Per-op error by kind" in html and "data:image/png;base64," in html
    perfetto = json.loads((tmp_path / "v.json").read_text())
    assert validate_chrome(perfetto) == []
    assert {e["pid"] for e in perfetto["traceEvents"] if e["ph"] == "X"} == {0, 1, 2, 3, 1000, 1001, 1002, 1003}


def test_layout_rows_cells_and_bubbles(pair):
    pred = load_trace(pair[0])
    meas = load_trace(pair[1])
    lay = build_layout([pred, meas], ["pred", "meas"])
    assert [r.label for r in lay.rows[:2]] == ["pred r0 compute", "pred r0 comm"]
    assert lay.start.min() == 0  # both traces start at their first schedule op
    assert sorted(set(lay.text)) == [str(m) for m in range(6)]  # micro-batch labels
    # rank 0 idles while the pipeline fills and drains: its idle share is the makespan minus 6 F and 6 B
    assert lay.idle[0][0] == pytest.approx(1 - 6 * 30 / lay.stats[0].makespan_us)


def test_view_of_real_traces(mhcpipe, shared_traces, tmp_path):  # noqa: F811
    for name, ext in (("hta_nccl_data.json.gz", "png"), ("extrap_con_kernel.sqlite", "html"),
                      ("pipit_saxpy-mpi-cuda_nsys_perlmutter0.sqlite", "svg")):
        rc, out, err = mhcpipe("view", shared_traces / name, "-o", tmp_path / f"{name}.{ext}")
        assert rc == 0, err


def test_compare_cli_writes_table_markdown_json_and_overhead_chart(mhcpipe, pair, tmp_path):
    pred, meas = pair
    base_pred = one_f_one_b(4, 6, f=9, b=18).save(tmp_path / "bp.json")
    base_meas = one_f_one_b(4, 6, f=10, b=18, comm=1.5, source="measured").save(tmp_path / "bm.json")
    rc, out, err = mhcpipe("compare", pred, meas, "--baseline-pred", base_pred, "--baseline-meas", base_meas,
                           "--json", tmp_path / "c.json", "--markdown", tmp_path / "c.md", "--plot", tmp_path / "o.png")
    assert rc == 0, err
    assert "Per-op error by kind" in out and "mHC overhead" in out and " pp" in out
    d = json.loads((tmp_path / "c.json").read_text())
    # the measured run's first (warm-up) step is dropped, as critical-path, whatif and the demo's report drop it
    assert d["matched"] == 120 and d["steps"] == 1 and d["overhead"]["pred_pct"] > 0
    assert (tmp_path / "c.md").read_text().startswith("# Predicted vs measured")
    assert imread(tmp_path / "o.png").shape[1] > 500
    rc, out, err = mhcpipe("compare", pred, meas, "--keep-warmup", "--json", tmp_path / "k.json")
    assert rc == 0, err
    k = json.loads((tmp_path / "k.json").read_text())
    assert k["matched"] == 2 * 120 and k["steps"] == 2


@pytest.mark.parametrize("args, message", [
    (("compare", "{pred}", "{tmp}/nope.json"), "nope.json: no such file"),
    (("compare", "{pred}", "{meas}", "--baseline-pred", "{pred}"), "--baseline-pred and --baseline-meas go together"),
    (("compare", "{meas}", "{pred}"), "arguments are swapped"),
    (("compare", "{pred}", "{other}"), "different schedules"),
    (("compare", "{pred}", "{truncated}"), "not valid JSON"),
    (("view", "{meas}", "-o", "{tmp}/x.pdf"), "use one of .png, .svg, .html, .json"),
    (("view", "{tmp}/empty.json", "-o", "{tmp}/x.png"), "the file is empty"),
])
def test_cli_errors_are_one_line_exit_2(mhcpipe, pair, tmp_path, args, message):
    pred, meas = pair
    one_f_one_b(4, 6, kind="zb1p", source="simulated").save(tmp_path / "other.json")
    other = json.loads((tmp_path / "other.json").read_text())
    other["meta"]["source"] = "measured"
    (tmp_path / "other.json").write_text(json.dumps(other))
    (tmp_path / "truncated.json").write_text(meas.read_text()[:500])
    (tmp_path / "empty.json").write_text("")
    subs = {"pred": pred, "meas": meas, "tmp": tmp_path, "other": tmp_path / "other.json",
            "truncated": tmp_path / "truncated.json"}
    rc, out, err = mhcpipe(*(a.format(**subs) for a in args))
    assert rc == 2
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_many_spans_render_to_png_and_html(tmp_path):
    """A long run draws: 8 ranks x 230 micro-batches (10,120 spans). The time at 10^5 spans is
    bench/trace_scale.py's (bench/results/trace_scale.json)."""
    big = one_f_one_b(8, 230)
    assert len(big.spans) > 10_000
    write_picture(tmp_path / "big.png", [big])
    write_html(tmp_path / "big.html", [big])
    assert imread(tmp_path / "big.png").shape[1] >= 1400
    html = (tmp_path / "big.html").read_text()
    assert html.count("F/s7/mb229") >= 1 and html.count("B/s0/mb229") >= 1


def test_a_trace_of_ranges_only_is_busy_where_its_ranges_are():
    """A foreign trace with neither schedule ops nor kernels (CPU or NVTX ranges): its ranges are the busy time,
    not 100% idle."""
    from traces.trace import Span, Trace
    from traces.drawing.view import breakdown

    t = Trace([Span(0, "cpu", "range", None, None, 0.0, 10.0, name="a"),
               Span(0, "cpu", "range", None, None, 4.0, 2.0, name="inner"),
               Span(1, "cpu", "range", None, None, 2.0, 8.0, name="b")], {"source": "imported"})
    ranks, parts = breakdown(t)
    assert ranks == [0, 1] and parts["range"] == [10.0, 8.0] and parts["idle"] == [0.0, 2.0]
