"""The self-contained HTML view in a real browser (issue 34 item 4): headless Chromium (Debian's `chromium`, which
.ci/run installs where missing) loads the file, draws the timeline's spans on its canvas and logs no JavaScript
error. bench/results/html_view_chromium.png is the same browser on `mhcpipe view runs/x -o v.html` of a tiny-moe
pp2 x dp2 x ep2 run (chromium FLAGS below --screenshot=... file:///.../v.html)."""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from schedules import build, simulate
from traces.drawing.html_view import write_html

BROWSER = shutil.which("chromium") or shutil.which("chromium-headless-shell")
# Chromium on a closed network, as root: no sandbox, no GPU, no background connections (its default ones are
# refused here, many at a time), a fresh profile
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--enable-logging=stderr", "--v=0", "--window-size=1400,900"]
F_ORANGE = np.array([0xF4, 0xA2, 0x59]) / 255.0  # the view's forward colour (traces.drawing.plot.KIND_COLORS["F"])


def screenshot(html, out, tmp_path) -> str:
    run = subprocess.run([BROWSER, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={out}",
                          html.as_uri()], capture_output=True, text=True, timeout=90)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stderr


@pytest.mark.skipif(BROWSER is None, reason="no chromium here (.ci/run installs Debian's chromium)")
@pytest.mark.timeout(120)
def test_html_view_renders_its_spans_in_headless_chromium(tmp_path):
    from matplotlib.image import imread

    trace = simulate(build("dualpipev", 4, 8)).trace
    trace.meta["source"] = "predicted"
    html = write_html(tmp_path / "v.html", [trace], title="dualpipev P4 M8")
    log = screenshot(html, tmp_path / "shot.png", tmp_path)
    errors = [ln for ln in log.splitlines() if "CONSOLE" in ln and ("Uncaught" in ln or "Error" in ln)]
    assert not errors, errors
    img = imread(tmp_path / "shot.png")[..., :3]
    assert img.shape[:2] == (900, 1400)
    # the canvas drew the forward ops: their orange covers a real area of the page (not just the legend swatch)
    orange = np.all(np.abs(img - F_ORANGE) < 0.03, axis=-1)
    assert orange.sum() > 2000, orange.sum()
    assert len(np.unique((img * 255).astype(np.uint8).reshape(-1, 3), axis=0)) > 20
