"""What every trace analysis says about a fixed set of traces, as data: the golden record
`tests/traces/data/analysis_golden.json` holds it, test_analysis_golden.py diffs the present code against it.

Subjects: three traces of this project's own runs kept in tests/traces/data (a measured DualPipeV run of the tiny
model with mHC, 4 gloo ranks, 3 steps; its prediction; a measured pp2 x dp2 run on the emulated CUDA device),
simulated steps of every schedule kind (seeded per-stage costs, written and read back as files), a multi-step
1F1B timeline, and the third-party files of ../shared/data/traces (when present). Commands: critical-path,
overlap, whatif (--scale F=0.5), view (Perfetto JSON), and compare (the prediction against its measured run);
each one's exit code, printed text and JSON, with paths written as <tmp>, <data>, <shared>. A JSON over 200 kB
(Perfetto exports, the per-op tables of large third-party files) is kept as its span count and a digest of its text:
these are the trace's own numbers converted, no sums whose order could differ between machines. The outputs on
third-party files are kept as digests only (the record holds nothing of those files).

    .venv/bin/python tests/traces/analysis_outputs.py --write    # record the present code's outputs

Write the record only when an output changes on purpose, and say why in the commit. The script runs on older
revisions too (cd <worktree>; PYTHONPATH=<worktree> python /path/to/this/file): 33aec06's code, before issue 58's
speed work, gives every output of the record but one, the Perfetto export of the pp2 x dp2 run, whose critical-path
thread moved from pipeline rank 1's process to global rank 2's (cdd7b02's fix: the path of a data-parallel run
lies on global ranks).
"""
from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import random
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
GOLDEN = DATA / "analysis_golden.json.gz"
SHARED = HERE.parents[1].parent / "shared" / "data" / "traces"
FIXTURES = ("measured_dualpipev_tiny", "predicted_dualpipev_tiny", "measured_emulated_pp2_dp2")
KINDS = ("gpipe", "1f1b", "zb1p", "dualpipe", "dualpipev")
MAX_KEPT = 200_000  # characters of a JSON output kept whole


def _simulated(kind: str, out: Path) -> Path:
    from schedules import Durations, build, simulate

    rng = random.Random(f"{kind}-58")
    per_stage = {s: {"F": float(rng.randint(2, 9)), "I": float(rng.randint(2, 9)), "W": float(rng.randint(1, 5))}
                 for s in range(8)}
    sim = simulate(build(kind, 4, 8), Durations(per_stage=per_stage, p2p_latency=0.5), p2p="rendezvous")
    path = out / f"simulated_{kind}.json"
    sim.trace.save(path)
    return path


def _timeline(out: Path) -> Path:
    sys.path.insert(0, str(HERE))
    from traces_testlib import one_f_one_b

    path = out / "timeline_1f1b_3steps.json"
    one_f_one_b(4, 6, f=lambda r, m: 10.0 + r + m % 3, b=lambda r, m: 20.0 + 2 * r, source="measured",
                steps=3).save(path)
    return path


def subjects(out: Path) -> dict[str, Path]:
    """name -> trace file (the simulated ones written into `out`)."""
    got = {name: DATA / f"{name}.json.gz" for name in FIXTURES}
    got.update({f"simulated_{k}": _simulated(k, out) for k in KINDS})
    got["timeline_1f1b_3steps"] = _timeline(out)
    if SHARED.is_dir():
        got.update({f"shared/{p.name}": p for p in sorted(SHARED.iterdir()) if p.name != "SOURCES.md"})
    return got


def _run(argv: list[str], json_out: Path | None, places: dict[str, str]) -> dict:
    from mhcpipe.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse
            rc = e.code
    got = {"rc": rc, "stdout": _placed(out.getvalue(), places), "stderr": _placed(err.getvalue(), places)}
    if json_out is not None and json_out.exists():
        text = _placed(json_out.read_text(), places)
        json_out.unlink()
        if len(text) <= MAX_KEPT:
            got["json"] = json.loads(text)
        else:
            data = json.loads(text)
            events = data.get("traceEvents") if isinstance(data, dict) else None
            got["json_digest"] = {"bytes": len(text), "sha256": hashlib.sha256(text.encode()).hexdigest(),
                                  "events": len(events) if isinstance(events, list) else None}
    return got


def _digest(text: str) -> dict:
    return {"bytes": len(text), "sha256": hashlib.sha256(text.encode()).hexdigest()}


def _digested(got: dict) -> dict:
    """A third-party file's outputs as digests (its op names stay out of the record)."""
    out = {"rc": got["rc"], "stdout_digest": _digest(got["stdout"]), "stderr_digest": _digest(got["stderr"])}
    if "json" in got:  # numbers to 10 significant digits: a sum in another order must not change the digest
        out["json_digest"] = _digest(json.dumps(_rounded(got["json"]), sort_keys=True))
    elif "json_digest" in got:
        out["json_digest"] = got["json_digest"]
    return out


def _rounded(x):
    if isinstance(x, float):
        return float(f"{x:.10g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


def _placed(text: str, places: dict[str, str]) -> str:
    for path, name in sorted(places.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(path, name)
    return text


def outputs(names: list[str] | None = None) -> dict[str, dict[str, dict]]:
    """subject -> command -> {rc, stdout, stderr, json}."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        subs = subjects(out)
        places = {str(out): "<tmp>", str(DATA): "<data>", str(SHARED): "<shared>"}
        result: dict[str, dict[str, dict]] = {}
        for name, path in subs.items():
            if names is not None and name not in names:
                continue
            t = str(path)
            j = out / "out.json"
            result[name] = {
                "critical-path": _run(["critical-path", t, "--json", str(j)], j, places),
                "overlap": _run(["overlap", t, "--json", str(j)], j, places),
                "whatif F=0.5": _run(["whatif", t, "--scale", "F=0.5", "--json", str(j)], j, places),
                "view perfetto": _run(["view", t, "-o", str(j)], j, places),
            }
            if name.startswith("shared/"):
                result[name] = {cmd: _digested(got) for cmd, got in result[name].items()}
        if names is None or "compare" in names:
            pred, meas = (str(DATA / f"{n}.json.gz") for n in FIXTURES[1::-1])
            j = out / "out.json"
            result["compare"] = {"compare": _run(["compare", pred, meas, "--json", str(j)], j, places)}
        return result


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: analysis_outputs.py --write  (records the present code's outputs in " + str(GOLDEN) + ")")
    with gzip.open(GOLDEN, "wt") as f:
        f.write(json.dumps(outputs(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
