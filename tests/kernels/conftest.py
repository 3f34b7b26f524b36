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
        _cache_language_members(monkeypatch)
    return FUSED_DEVICE


def _cache_language_members(monkeypatch) -> None:
    """The interpreter patches triton.language for the interpreter when a kernel launches and again on every call
    of a @triton.jit helper from inside it, per program: each patch walks the language modules with
    inspect.getmembers to find their builtins, about half of a kernel test's time. The modules' builtins do not
    change, so they are listed once (here, before any launch) and each patch visits only those names, with the
    interpreter's own test and patch per name: the same attributes patched as before. Triton versions without
    these internals keep their own behaviour."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter as ti

    original, patch_attr = getattr(ti, "_patch_builtin", None), getattr(ti, "_patch_attr", None)
    if original is None or patch_attr is None or getattr(original, "cached_names", False):
        return
    is_builtin = tl.core.is_builtin
    pkgs = [tl, tl.core, tl.tensor, tl.math, getattr(tl.core, "tensor_descriptor_base", None)]
    names = {id(p): [n for n, m in inspect.getmembers(p) if is_builtin(m)] for p in pkgs if p is not None}

    def patch_builtin(pkg, builder, scope):
        listed = names.get(id(pkg))
        if listed is None:
            return original(pkg, builder, scope)
        for name in listed:
            member = getattr(pkg, name, None)
            if is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    patch_builtin.cached_names = True
    monkeypatch.setattr(ti, "_patch_builtin", patch_builtin)
