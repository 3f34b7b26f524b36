"""The wider residuals and the diagnostics from the command line, as a user runs them: `--residual xhc:16:4` and
`--residual mhc-sp:4` train on 2 gloo ranks with `--diagnostics-every`, `mhcpipe diagnose` draws the result;
bad residual flags are one line naming the field, before any rank starts."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from _pipeline_helpers import mhcpipe_in_process, tiny_config
from configs import parse_config
from pipeline.launch.run_args import with_residual_flag

ROOT = Path(__file__).resolve().parents[2]


def _mhcpipe(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "mhcpipe", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})


def test_residual_flag_parses_xhc_and_single_pass():
    cfg = parse_config(tiny_config("1f1b", 2))
    x = with_residual_flag(cfg, "--residual", "xhc:16:4")
    assert (x.model.residual.variant, x.model.residual.n, x.model.residual.k) == ("xhc", 16, 4)
    assert x.model.residual.label == "xhc:16:4"
    assert with_residual_flag(cfg, "--residual", "xhc:8").model.residual.k == 4  # the default k
    sp = with_residual_flag(x, "--residual", "mhc-sp:4")  # leaving xhc drops its active-stream count
    assert (sp.model.residual.variant, sp.model.residual.active) == ("mhc-sp", None)
    assert sp.model.residual.label == "mhc-sp:4"


@pytest.mark.parametrize("value,needle", [
    ("xhc:4:5", "active=5 > n=4"),
    ("mhc:4:2", "only xhc takes N:K"),
    ("xhc:16:x", "use VARIANT:N"),
    ("bogus:4", "model.residual"),
])
def test_bad_residual_flags_are_one_line(value, needle):
    cfg = parse_config(tiny_config("1f1b", 2))
    with pytest.raises(ValueError) as err:
        with_residual_flag(cfg, "--residual", value)
    msg = str(err.value)
    assert needle in msg and "\n" not in msg, msg


def test_bad_xhc_config_fields_are_one_line(tmp_path):
    cfg = tiny_config("1f1b", 2)
    cfg["model"]["residual"] = {"variant": "xhc", "n": 16, "active": 4, "augment": "attention"}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = mhcpipe_in_process("run", "--config", str(path), "--steps", "1")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "augment" in lines[0] and "MLP write-back only" in lines[0], proc.stderr
    proc = mhcpipe_in_process("run", "--config", "tiny", "--residual", "mhc:4", "--diagnostics-every", "5",
                           "--steps", "1")
    assert proc.returncode == 2 and "--diagnostics-dir" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.timeout(300)
def test_run_logs_diagnostics_and_diagnose_draws_them(tmp_path):
    """One real launch trains xHC and single-pass mHC interleaved (`--interleave`), each logging its diagnostics
    to its own folder; `mhcpipe diagnose` draws each one."""
    from mhcpipe.cli import main

    cfg = tiny_config("dualpipev", 2, steps=3)
    path = tmp_path / "tiny2.yaml"
    path.write_text(yaml.safe_dump(cfg))
    diag = tmp_path / "diag"
    proc = _mhcpipe("run", "--config", str(path), "--residual", "xhc:16:4", "--interleave", "mhc-sp:4",
                    "--diagnostics-every", "2", "--diagnostics-dir", str(diag))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in diag.iterdir()) == ["mhc-sp_4", "xhc_16_4"]
    for residual in ("xhc:16:4", "mhc-sp:4"):
        folder = diag / residual.replace(":", "_")
        assert sorted(p.name for p in folder.iterdir()) == ["diagnostics_rank0.json", "diagnostics_rank1.json"]
        png, out = tmp_path / f"{folder.name}.png", tmp_path / f"{folder.name}.json"
        assert main(["diagnose", str(folder), "-o", str(png), "--json", str(out)]) == 0
        assert png.stat().st_size > 10_000
        runs = json.loads(out.read_text())
        run = runs[0] if isinstance(runs, list) else runs["runs"][0]
        n = int(residual.split(":")[1])
        assert run["streams"] == n and run["layers"] == 2 * cfg["model"]["num_blocks"], (residual, run)
        assert run["steps_logged"] == [0, 2]  # step 0, every 2nd, and the last (2)
        last = run["last"]
        if residual.startswith("xhc"):
            # k = 4 of 16 streams are written per token: some stream is never written by most tokens
            assert last["write_share_min"] < 1.0 / n
        assert 0.99 < last["gain_fwd"] < 1.01  # Sinkhorn-projected H_res (rows sum to 1): no gain forward
