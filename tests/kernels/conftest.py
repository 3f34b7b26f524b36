"""Kernel tests: run the fused Triton kernels on CUDA when present, else on CPU under the Triton interpreter.

TRITON_INTERPRET is read when a @triton.jit function is decorated and again by triton at launch, so it is set
while kernels.fused is first imported and, per test, by the `fused_device` fixture (monkeypatch), then
restored: other test folders keep the reference backend on CPU and never see the variable.
"""
from __future__ import annotations

import os

import pytest
import torch


def _fused_device() -> str | None:
    if torch.cuda.is_available():
        return "cuda"
    prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import kernels.fused as fused
    except ImportError:
        return None
    finally:
        if prev is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = prev
    # Imported earlier without the interpreter (e.g. by another test folder): the kernels cannot run on CPU.
    return "cpu" if fused.INTERPRETED else None


FUSED_DEVICE = _fused_device()


@pytest.fixture
def fused_device(monkeypatch) -> str:
    if FUSED_DEVICE is None:
        pytest.skip("triton is not installed, or kernels.fused was imported without TRITON_INTERPRET on CPU")
    if FUSED_DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return FUSED_DEVICE
