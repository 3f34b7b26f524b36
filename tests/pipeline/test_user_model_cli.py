"""A user's model end to end: `torchrun examples/....py` (the user's own script) trains, traces like the built-in
model, checkpoints and resumes; `mhcpipe check-split` from the command line; bad input in one line."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _pipeline_helpers import mhcpipe_in_process
from pipeline.launch.local import free_port
from traces.trace import Trace

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}


def torchrun(script: str, nproc: int, *args, timeout=200):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                           "--master-port", str(free_port()), script, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=ENV)


def mhcpipe(*args, timeout=200):
    return subprocess.run([sys.executable, "-m", "mhcpipe", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def losses(stdout: str) -> list[float]:
    return [float(ln.split("loss ")[1].split()[0]) for ln in stdout.splitlines() if ln.startswith("step ")]


def span_kinds(trace: dict) -> set[str]:
    """What a span is, without its stage, micro-batch or layer: F, FB, SEND_F~comm, F/L.block, WAIT, ..."""
    out = set()
    for s in trace["spans"]:
        parts = s["name"].split("/")
        suffix = parts[-1].split("~")[-1] if "~" in parts[-1] else ""
        piece = parts[-1].split(".", 1)[-1].split("~")[0] if len(parts) > 3 else ""
        out.add("/".join(p for p in (parts[0], piece, suffix) if p))
    return out


def median_span(trace: dict, kind: str) -> float:
    """Median duration of the spans of one action kind (`W/s3/mb1`) over every rank and step (a median: a span that
    a busy host preempts once does not move it)."""
    import statistics

    return statistics.median(s["duration"] for s in trace["spans"]
                             if s["name"].split("/")[0] == kind and s["name"].count("/") == 2)


def interleaved_pairs(trace: dict) -> int:
    """F&B pairs in whose window the stretches of the two halves alternate (F, B, F or B, F, B by start time)."""
    count = 0
    for frame in (s for s in trace["spans"] if s["name"].startswith("FB/")):
        end = frame["start"] + frame["duration"]
        pieces = sorted((s for s in trace["spans"] if s["rank"] == frame["rank"] and s["name"].count("/") == 3
                         and s["name"][0] in "FB" and "~" not in s["name"] and not s["name"].startswith("FB")
                         and frame["start"] <= s["start"] < end), key=lambda s: s["start"])
        letters = "".join(s["name"][0] for s in pieces)
        count += "FBF" in letters or "BFB" in letters
    return count


@pytest.mark.timeout(300)
def test_the_hyper_connections_model_trains_traces_and_draws_like_the_built_in_one(tmp_path):
    user = torchrun("examples/hc_model.py", 4, "--schedule", "dualpipev", "--steps", "2", "--trace-dir",
                    str(tmp_path / "user"))
    assert user.returncode == 0, user.stderr[-3000:]
    assert len(losses(user.stdout)) == 2
    assert "note: a user model: F&B pairs" in user.stdout, user.stdout
    ours = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
                        str(free_port()), "-m", "pipeline", "--config", "tiny", "--schedule", "dualpipev", "--steps",
                        "2", "--trace-dir", str(tmp_path / "ours")], cwd=ROOT, capture_output=True, text=True,
                       timeout=200, env=ENV)
    assert ours.returncode == 0, ours.stderr[-3000:]
    tu = Trace.load(tmp_path / "user" / "trace.json").to_records()
    to = Trace.load(tmp_path / "ours" / "trace.json").to_records()
    assert tu["meta"].keys() == to["meta"].keys()
    assert tu["meta"]["model"] == "hyper-connections-mhc (user model)"
    assert tu["meta"]["schedule"] == to["meta"]["schedule"] and tu["meta"]["pipelines"] == to["meta"]["pipelines"]
    # the same actions and transfers; the built-in model's MLP post+res spans on its hp stream are its own, and the
    # user model's phased blocks add the stretches of its interleaved F&B halves (the built-in dense model, without
    # expert all-to-alls, runs its pairs' halves one after the other)
    ku, ko = span_kinds(tu), span_kinds(to)
    stretches = {k for k in ku if k.count("/") == 1 and k.split("/")[0] in ("F", "B")}
    assert {"F/attention", "F/mlp", "B/attention", "B/mlp"} <= stretches, sorted(ku)
    assert ku - stretches == ko - {"F/post_res/hp"}, ku ^ ko
    assert interleaved_pairs(tu) > 0
    assert "F&B pairs hand the turn between their halves at every phase boundary" in user.stdout
    assert {s["name"] for s in tu["spans"]} >= {"F/s0/mb0", "SEND_F/s0/mb0~comm", "RECV_F/s0/mb0~comm"}
    plain = torchrun("examples/plain_transformer.py", 4, "--schedule", "dualpipev", "--residual", "mhc:4", "--steps",
                     "2", "--trace-dir", str(tmp_path / "plain"))
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert "F&B pairs run their halves one after the other (its blocks expose no phases" in plain.stdout
    tp = Trace.load(tmp_path / "plain" / "trace.json").to_records()
    assert interleaved_pairs(tp) == 0
    # where the weight-gradient GEMMs ran: the plain transformer's DeferLinear moves them from I to W (as the
    # built-in model's do), the hyper-connections model's nn.Linear leaves W empty and the run says so
    assert "W is empty" in user.stdout and "W is empty" not in plain.stdout
    assert median_span(tp, "W") > 10 * median_span(tu, "W"), (median_span(tp, "W"), median_span(tu, "W"))
    for out in ("schedule.png", "schedule.html"):
        view = mhcpipe("view", str(tmp_path / "user" / "trace.json"), "-o", str(tmp_path / out))
        assert view.returncode == 0, view.stderr
        assert (tmp_path / out).stat().st_size > 10_000
    cp = mhcpipe("critical-path", str(tmp_path / "user" / "trace.json"))
    assert cp.returncode == 0 and "critical path" in cp.stdout.lower(), cp.stdout + cp.stderr


@pytest.mark.timeout(300)
def test_a_wrapped_plain_transformer_checkpoints_and_resumes_to_the_uninterrupted_losses(tmp_path):
    flags = ("--schedule", "1f1b", "--residual", "mhc:4")
    full = torchrun("examples/plain_transformer.py", 2, *flags, "--steps", "3")
    assert full.returncode == 0, full.stderr[-3000:]
    ckpt = tmp_path / "ckpt"
    first = torchrun("examples/plain_transformer.py", 2, *flags, "--steps", "2", "--checkpoint-dir", str(ckpt))
    assert first.returncode == 0, first.stderr[-3000:]
    again = torchrun("examples/plain_transformer.py", 2, "--schedule", "dualpipev", "--residual", "mhc:4",
                     "--steps", "3", "--checkpoint-dir", str(ckpt), "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    want, got = losses(full.stdout), losses(again.stdout)
    assert len(got) == 1 and abs(got[0] - want[2]) <= 1e-5 * abs(want[2]), (want, got)
    assert losses(first.stdout) == want[:2]
    other = torchrun("examples/plain_transformer.py", 2, "--schedule", "1f1b", "--residual", "residual:1",
                     "--steps", "3", "--checkpoint-dir", str(ckpt), "--resume", timeout=120)
    assert other.returncode != 0
    lines = [ln for ln in other.stderr.splitlines() if "plain_transformer.py: error (rank" in ln]
    assert lines and all("was written by another model config (model.residual" in ln for ln in lines), \
        other.stderr[-2000:]


def test_check_split_from_the_command_line_ok_and_one_line_refusals(tmp_path):
    ok = mhcpipe("check-split", "examples/hc_model.py:build", "--schedule", "dualpipev,zb1p", "--layouts", "pp2",
                 "--json", str(tmp_path / "cs.json"))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "dualpipev  pp2 x dp1  ok    worst relative error" in ok.stdout
    assert ok.stdout.splitlines()[-1].startswith("ok: 2/2 cases agree; worst relative error")
    cases = json.loads((tmp_path / "cs.json").read_text())["cases"]
    assert [c["ok"] for c in cases] == [True, True] and all(c["worst_relative_error"] < 1e-9 for c in cases)

    for args, want in (
            (["nofile.py:build"], "model 'nofile.py:build': nofile.py does not exist"),
            (["examples/hc_model.py:build", "--layouts", "pp0"], "--layouts 'pp0': each item is ppP or ppPxdpD"),
            (["examples/hc_model.py:build", "--schedule", "1f2b"], "--schedule '1f2b': use 'all' or a comma list"),
            (["examples/hc_model.py:build", "--layouts", "pp16"],
             "error: gpipe pp16 x dp1: model.num_blocks=8 cannot fill 16 pipeline stages"),
            (["examples/plain_transformer.py:build", "--residual", "xhc:4"],
             "residual 'xhc'"),
    ):
        out = mhcpipe_in_process("check-split", *args)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        err = out.stderr.strip()
        assert err.count("\n") == 0 and want in err and "Traceback" not in err, (args, err)


def test_a_model_whose_split_differs_exits_1_naming_the_stage(tmp_path):
    """A realistic user bug that no shape check sees: dropout left on. Each rank draws its own masks, so the split
    does not compute what one process does."""
    f = tmp_path / "dropout.py"
    f.write_text(f"""
import sys
sys.path.insert(0, {str(ROOT / 'examples')!r})
from torch import nn
from plain_transformer import build as build_plain


class Dropped(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block, self.drop = block, nn.Dropout(0.1)

    def forward(self, x):
        return self.drop(self.block(x))


def build(seq_len: int = 32):
    model = build_plain("mhc:4", seq_len)
    model.blocks[2] = Dropped(model.blocks[2])
    return model
""")
    out = mhcpipe("check-split", f"{f}:build", "--schedule", "1f1b", "--layouts", "pp2")
    assert out.returncode == 1, out.stdout + out.stderr
    line = [ln for ln in out.stdout.splitlines() if "FAIL" in ln][0]
    assert "1f1b       pp2 x dp1  FAIL  stage 0 (rank 0, blocks 0-3) micro-batch 0: the state it sends differs" \
        in line, line


def test_a_user_script_refuses_bad_input_in_one_line_before_any_rank_starts(monkeypatch, capsys):
    from pipeline.launch.entry import main
    from pipeline.launch.user_config import load_builder

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    build = load_builder(f"{ROOT}/examples/hc_model.py:build")
    for flags, want in ((["--diagnostics-every", "1", "--diagnostics-dir", "unused"],
                         "--diagnostics-every (reads the built-in mHC coefficients): not for a user model; drop it"),
                        (["--residual", "mhc:4"], "takes no residual argument"),
                        (["--schedule", "dualpipev", "--pp", "8"], "cannot fill")):
        assert main(flags, build=build) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and want in err, err
