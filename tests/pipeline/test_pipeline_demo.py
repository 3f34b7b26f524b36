"""`mhcpipe demo` end to end (what `make demo` runs): calibrate, run baseline and mHC interleaved in one torchrun
job on 4 gloo ranks, predict, compare, and write the report and pictures. Accuracy is not asserted here (it depends on the
machine's load); bench/predict_local.py measures it."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_writes_report_pictures_and_perfetto_trace(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "mhcpipe", "demo", "--out", str(out), "--steps", "2"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for step in ("[1/5]", "[2/5]", "[3/5]", "[4/5]", "[5/5]"):
        assert step in proc.stdout
    for name in ("mhc_4", "residual_1"):
        assert (out / "measured" / name / "trace.json").exists()
    last = proc.stdout.strip().splitlines()[-3:]
    assert "report.md" in last[0] and "mHC overhead: predicted" in last[2]
    report = (out / "report.md").read_text()
    assert "| mHC overhead |" in report and "| baseline step (n=1) |" in report
    for png in ("schedule.png", "overhead.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    assert any(n.startswith("predicted") for n in names) and any(n.startswith("measured") for n in names)
    comparison = json.loads((out / "comparison.json").read_text())
    assert comparison["overhead"]["meas_pct"] > 0 and comparison["matched"] > 0
