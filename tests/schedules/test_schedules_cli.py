"""`mhcpipe schedule` end to end, as a user runs it."""
import json
import subprocess
import sys

import pytest

from mhcpipe.cli import main


def test_schedule_command_writes_everything(tmp_path, capsys):
    outs = [tmp_path / n for n in ("s.png", "s.svg", "s.csv", "s.json")]
    args = ["schedule", "--kind", "dualpipev", "--ranks", "4", "--microbatches", "10", "--cost", "F=1,B=2,W=1"]
    for o in outs:
        args += ["-o", str(o)]
    args += ["--trace", str(tmp_path / "t.json"), "--perfetto", str(tmp_path / "p.json")]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "rank  0:" in text and "formula (PP/2-1)(F&B+B-3W) = 6" in text and "simulated 6" in text
    assert "peak live activations: 9 chunks" in text
    for o in outs:
        assert o.stat().st_size > 0
    assert outs[0].read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "p.json").read_text())["traceEvents"]
    assert json.loads((tmp_path / "t.json").read_text())["format"] == "mhc-pipe-trace"


@pytest.mark.parametrize("args, message", [
    (["--kind", "dualpipe", "--ranks", "3", "--microbatches", "12"], "even number of ranks"),
    (["--kind", "1f1b", "--ranks", "4", "--microbatches", "2"], "microbatches >= ranks"),
    (["--kind", "1f1b", "--ranks", "4", "--microbatches", "8", "--cost", "F=x"], "--cost"),
    (["--kind", "1f1b", "--ranks", "4", "--microbatches", "8", "-o", "x.pdf"], "unknown output type"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    assert main(["schedule"] + args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_console_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "mhcpipe", "schedule", "--kind", "zb1p", "--ranks", "4",
                          "--microbatches", "8"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "formula (P-1)(F+B-2W) = 3" in out.stdout


def test_schedule_only_demo(tmp_path, capsys):
    assert main(["demo", "--schedule-only", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "makespan 66" in text and "idle [6.0]" in text
    assert (tmp_path / "schedule_dualpipe.png").stat().st_size > 10_000
