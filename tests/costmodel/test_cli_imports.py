"""`mhcpipe predict`, `mhcpipe tune` and `mhcpipe layout` answer without importing torch (the layout's rank
arrays are numpy's) (configs and the cost model are torch-free;
`kernels` loads its torch modules on first use): the import alone was 1.3 of the 2.5-3.4 s a V3 prediction took."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import io, sys, contextlib
from mhcpipe.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    rc = main(sys.argv[1:])
print(rc, sorted(m for m in ("torch", "triton", "kernels.module") if m in sys.modules))
"""


@pytest.mark.parametrize("argv", [["predict", "--preset", "paper-27b"],
                                  ["tune", "--preset", "paper-27b", "--gpus", "64"],
                                  ["layout", "--config", "configs/deepseek-v3.yaml"]])
def test_the_cost_model_cli_imports_no_torch(argv):
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip() == "0 []", proc.stdout + proc.stderr[-2000:]


def test_kernels_names_still_resolve_lazily():
    import kernels

    assert kernels.MHCConfig.__name__ == "MHCConfig" and kernels.MHCSublayer.__module__ == "kernels.module"
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        kernels.nothing
