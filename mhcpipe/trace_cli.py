"""`mhcpipe view` and `mhcpipe compare`.

    mhcpipe view TRACE [--predicted PRED] -o out.png|.svg|.html|.json [--no-critical-path]
    mhcpipe compare PRED MEAS [--baseline-pred P --baseline-meas M] [--json out.json] [--markdown out.md]
                    [--plot overhead.png]

`view` outlines each trace's critical path in red (Perfetto JSON: a `critical path` thread per rank with flow
arrows); `compare` adds both critical paths and, with the baseline pair, mHC's overhead along them by cause
(`mhcpipe critical-path` lists one path in full).

TRACE, PRED and MEAS are any format `traces.formats.io.load_trace` reads (our JSON, Chrome/Perfetto JSON, PyTorch
profiler
JSON[.gz], Nsight Systems SQLite, nsys stats NVTX CSV[.xz]) or a folder of per-rank files.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from traces.analysis import path_report
from traces.formats.chrome import chrome_to_traces, is_predicted, validate_chrome, to_chrome
from traces.analysis.compare import compare
from mhcpipe.analysis_cli import load_for_analysis, load_steps
from traces.formats.io import json_columns, json_file_trace, load_trace, one_pass_columns, sniff, streamed_trace
from traces.formats.kineto import is_kineto, read_json
from traces.analysis.matching import drop_warmup_step
from traces.analysis.step_select import file_trace
from traces.names import STEP_KIND
from traces.drawing.path_marks import chrome_path_events, paths_for
from traces.drawing.replica_summary import summarise_replicas
from traces.analysis.report import to_markdown, to_text, write_json, write_markdown
from traces.trace import FORMAT_NAME, Trace, TraceError

VIEW_SUFFIXES = (".png", ".svg", ".html", ".json")


def register(subparsers) -> None:
    v = subparsers.add_parser("view", help="draw a trace (and its prediction): png, svg, html or Perfetto json",
                              description="Draw a trace (a run folder, a file, a prediction) with its critical path "
                              "outlined: png, svg, html or Perfetto json.\n\nexample:\n  mhcpipe view runs/x -o "
                              "runs/x/schedule.png [--predicted pred.json]",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("trace", help="measured (or any) trace file, or a folder of per-rank files")
    v.add_argument("--predicted", help="predicted trace drawn above the measured one, on the same time axis")
    v.add_argument("-o", "--output", required=True, help="output file: .png, .svg, .html or .json (Perfetto)")
    v.add_argument("--title", default="", help="picture title")
    v.add_argument("--streams", default=None,
                   help="comma-separated streams to draw (default: all, e.g. compute,hp,comm,cuda:7)")
    v.add_argument("--rank", type=int, default=None, help="rank of a single-process trace file without rank info")
    v.add_argument("--step", default=None, metavar="K|all",
                   help="which step of a measured trace to draw: K (counted from 0 after the warm-up step), or all; "
                        "default: the median step (the one critical-path analyses), so ops are wide enough to read")
    v.add_argument("--no-critical-path", dest="critical", action="store_false",
                   help="do not outline the critical path (drawn in red by default where the names allow it)")
    v.set_defaults(func=run_view)

    c = subparsers.add_parser("compare", help="predicted vs measured: per-op error, makespan, bubbles, overhead",
                              description="Predicted against measured: per-op error, makespan, bubbles, both critical "
                              "paths and, with the baseline pair, mHC's overhead along them.\n\nexample:\n  mhcpipe "
                              "compare pred.json runs/x --baseline-pred base_pred.json --baseline-meas runs/base",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("pred", help="predicted trace")
    c.add_argument("meas", help="measured trace (file or folder of per-rank files)")
    c.add_argument("--baseline-pred", help="predicted trace of the baseline (no mHC) run")
    c.add_argument("--baseline-meas", help="measured trace of the baseline (no mHC) run")
    c.add_argument("--json", dest="json_out", help="write the comparison as JSON here")
    c.add_argument("--markdown", dest="md_out", help="write the comparison as Markdown here")
    c.add_argument("--plot", dest="plot_out", help="write the mHC overhead breakdown chart here (.png/.svg; needs "
                                                   "the baseline pair)")
    c.add_argument("--keep-warmup", action="store_true", help="compare every measured step, the first (warm-up) "
                   "included; default: it is dropped, as critical-path, whatif and the demo's report drop it")
    c.add_argument("--steps", default=None, metavar="A..B", help="compare the measured run's steps A to B only (or "
                   "one step: A), counted from 0 as the file holds them (step 0: the warm-up), as `mhcpipe convert "
                   "--steps` cuts them")
    c.set_defaults(func=run_compare)


def _traces_in(path: str, rank: int | None = None) -> list[Trace]:
    """All traces in a file: a Chrome file of ours may hold a predicted and a measured trace."""
    p = Path(path)
    if p.is_file() and sniff(p) == "json":
        ours = one_pass_columns(p)  # ours as our writer writes it: columns in one pass
        if ours is not None:
            return [file_trace(ours)]
        streamed = streamed_trace(p, rank=rank)  # a PyTorch profiler file, event by event
        if streamed is not None:
            return [streamed]
        data = read_json(p)
        if isinstance(data, dict) and data.get("format") != FORMAT_NAME and not is_kineto(data) \
                and "traceEvents" in data:
            return chrome_to_traces(data, source=str(p))
        cf = json_columns(data, p)  # ours: read once, given away, as columns
        return [file_trace(cf) if cf is not None else json_file_trace(p, data, rank=rank, consume=True)]
    return [load_steps(path, rank=rank)]  # a .npz file: its steps found on the columns


def run_view(args: argparse.Namespace) -> int:
    out = Path(args.output)
    suffix = out.suffix.lower()
    if suffix not in VIEW_SUFFIXES:
        raise TraceError(f"output {out.name!r}: use one of {', '.join(VIEW_SUFFIXES)}")
    traces = _traces_in(args.trace, rank=args.rank)
    if args.predicted:
        pred = load_trace(args.predicted, which="predicted")
        if not is_predicted(pred):
            pred.meta = {**pred.meta, "source": "predicted"}
        traces = [pred] + [t for t in traces if not is_predicted(t)]
    traces.sort(key=lambda t: not is_predicted(t))  # predicted rows on top
    traces = [t if is_predicted(t) else one_step(t, args.step) for t in traces]
    if suffix != ".json":  # a picture of hundreds of ranks: one pipeline in full, the other replicas summarised
        traces = [summarise_replicas(t) for t in traces]
    streams = tuple(s.strip() for s in args.streams.split(",")) if args.streams else None
    paths, path_notes = paths_for(traces) if args.critical else ({}, [])
    path_notes = [t.meta["summary"] for t in traces if "summary" in t.meta] + path_notes
    if suffix == ".json":
        data = to_chrome(*traces)
        if args.critical:  # a `critical path` thread per rank, flows between its ops (traces.drawing.path_marks)
            data["traceEvents"].extend(chrome_path_events(traces, paths))
        problems = validate_chrome(data)
        if problems:
            raise TraceError(f"internal: the Chrome export is malformed: {problems[0]}")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data))
    elif suffix == ".html":
        from traces.drawing.html_view import markdown_tables_to_html, write_html
        comparison = ""
        preds = [t for t in traces if is_predicted(t)]
        meass = [t for t in traces if not is_predicted(t)]
        if preds and meass:
            comp = compare(preds[0], meass[0], critical=args.critical)
            comparison = markdown_tables_to_html(to_markdown(comp) + path_markdown(comp.critical_path))
        write_html(out, traces, title=args.title or _title(args, traces), comparison_html=comparison, streams=streams,
                   critical=args.critical, paths=paths)
    else:
        from traces.drawing.view import write_picture
        write_picture(out, traces, title=args.title or _title(args, traces), streams=streams, critical=args.critical,
                      paths=paths)
    n = sum(len(t.spans) for t in traces)
    print(f"wrote {out} ({n} spans, {sum(len(t.ranks) for t in traces)} rank rows"
          + (f", critical path of {len(paths)} trace(s) outlined" if paths else "") + ")")
    for note in path_notes:
        print(f"note: {note}")
    return 0


def one_step(trace: Trace, step: str | None) -> Trace:
    """A measured trace's step to draw (`--step`): the median step after the warm-up by default, K, or all of them.
    A trace without schedule steps (a foreign one) is drawn whole."""
    from traces.analysis.step_select import steps_of, step_trace

    if step is not None and step != "all" and not step.isdigit():
        raise TraceError(f"--step {step!r}: give a step number K (0 = the first after the warm-up) or all")
    if step == "all":
        return trace
    try:
        dropped = drop_warmup_step(trace)
        info = steps_of(dropped)
    except TraceError:
        if step is not None:
            raise TraceError(f"--step {step}: the trace has no schedule steps (names as in traces.md §5); draw it "
                             "whole (drop --step)") from None
        return trace
    if len(info.steps) <= 1 and step is None:
        return dropped
    _, t = step_trace(dropped, None if step is None else int(step), info)
    # one step drawn: its step range would only cover the ops it frames (the title says which step)
    return Trace([s for s in t.spans if s.kind != STEP_KIND], t.meta)


def path_markdown(critical: dict) -> str:
    """The critical-path tables of a comparison (Comparison.critical_path) as Markdown ('' when there are none)."""
    return path_report.to_markdown(path_report.compare_sections(critical))


def _title(args: argparse.Namespace, traces: list[Trace] | None = None) -> str:
    """The run the picture shows (traces.drawing.view.describe_run), else the file names."""
    from traces.drawing.view import describe_run

    meas = [t for t in traces or [] if not is_predicted(t)] or list(traces or [])
    what = describe_run(meas[0]) if meas else ""
    files = Path(args.trace).name + (f" vs prediction {Path(args.predicted).name}" if args.predicted else "")
    return f"{what}  ({files})" if what else files


def run_compare(args: argparse.Namespace) -> int:
    if bool(args.baseline_pred) != bool(args.baseline_meas):
        raise TraceError("--baseline-pred and --baseline-meas go together: give both (the baseline run's "
                         "prediction and measurement) or neither")
    if args.plot_out and not args.baseline_pred:  # before any output: the chart is mHC's overhead over a baseline
        raise TraceError("--plot draws mHC's overhead against a baseline: add --baseline-pred and --baseline-meas "
                         "(the baseline run's prediction and measurement), or drop --plot")
    # one reading of "the step" everywhere: the warm-up step dropped (analysis_cli.load_for_analysis)
    pred = load_steps(args.pred, which="predicted")  # from .npz: with its step arrays and key ids
    meas = load_for_analysis(args.meas, "measured", None, args.keep_warmup, args.steps)
    baseline = None
    if args.baseline_pred:
        baseline = (load_steps(args.baseline_pred, which="predicted"),
                    load_for_analysis(args.baseline_meas, "measured", None, args.keep_warmup, args.steps))
    comp = compare(pred, meas, baseline=baseline, names=(args.pred, args.meas))
    sys.stdout.write(to_text(comp))
    sys.stdout.write("\n" + path_report.to_text(path_report.compare_sections(comp.critical_path)))
    if args.json_out:
        write_json(comp, args.json_out)
    if args.md_out:
        write_markdown(comp, args.md_out)
        with open(args.md_out, "a") as fh:
            fh.write(path_markdown(comp.critical_path))
    if args.plot_out:
        from traces.drawing.overhead_chart import plot_overhead
        plot_overhead(comp, args.plot_out)
    return 0
