"""Choose the implementation of the mHC ops: fused Triton, the eager ops, or the pure-PyTorch reference.

'auto': fused on CUDA when triton imports; on CPU fused only while TRITON_INTERPRET=1 is set and the kernels
were built for the interpreter (the variable was set when kernels.fused was first imported, as the kernel
tests do); kernels.eager otherwise (the reference's math with Sinkhorn as one autograd node: same values and
gradients to rounding, several times fewer tiny ops). 'reference' is the unrolled definition of truth. 'fused'
raises a clear error when it cannot run. triton is imported lazily, so `import kernels` works on machines
without it.

TRITON_INTERPRET on a machine with CUDA is almost always a leftover from a CPU test run: once kernels.fused was
imported under it, 'auto' runs the eager ops on CUDA tensors (the interpreter cannot launch on CUDA), and CPU
tensors run interpreted. resolve() says so once per process with a RuntimeWarning.
"""
from __future__ import annotations

import functools
import importlib
import os
import warnings
from types import ModuleType

import torch

from . import eager, reference

_BACKENDS = ("auto", "reference", "fused")
_warned_interpret_on_cuda = False  # the TRITON_INTERPRET-with-CUDA warning is issued once per process


@functools.cache
def triton_available() -> bool:
    """Does triton import? (Asked once per process: resolve() runs for every op of every sub-layer.)"""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpret_env() -> bool:
    value = os.environ.get("TRITON_INTERPRET")
    return value is not None and value.strip().lower() in ("1", "true", "on", "yes")


def _fused_module() -> ModuleType:
    return importlib.import_module("kernels.fused")


def _warn_if_interpreted_on_cuda(fused: ModuleType) -> None:
    """Warn once when the Triton interpreter is in play (TRITON_INTERPRET set now, or kernels.fused built under
    it) although torch.cuda.is_available()."""
    global _warned_interpret_on_cuda
    if _warned_interpret_on_cuda or not (_interpret_env() or fused.INTERPRETED) or not torch.cuda.is_available():
        return
    _warned_interpret_on_cuda = True
    state = ("kernels.fused was imported with TRITON_INTERPRET set" if fused.INTERPRETED
             else "TRITON_INTERPRET is set")
    warnings.warn(
        f"{state} on a machine where CUDA is available: backend='auto' runs the pure-PyTorch (eager) ops on "
        "CUDA tensors (not the compiled Triton kernels) and the slow Triton interpreter on CPU tensors. Unset "
        "TRITON_INTERPRET before kernels.fused is first imported to use the compiled kernels.",
        RuntimeWarning, stacklevel=3)


def resolve(backend: str, x: torch.Tensor) -> ModuleType:
    """Return the module (kernels.fused, kernels.eager or kernels.reference) that implements the ops for x."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; choose one of {', '.join(_BACKENDS)}")
    if backend == "reference":
        return reference
    fused_ok_dtype = x.dtype in (torch.float32, torch.bfloat16)
    if backend == "auto":
        if not triton_available() or not fused_ok_dtype:
            return eager
        if x.is_cuda:
            fused = _fused_module()
            _warn_if_interpreted_on_cuda(fused)
            return eager if fused.INTERPRETED else fused
        if _interpret_env():
            fused = _fused_module()
            _warn_if_interpreted_on_cuda(fused)
            return fused if fused.INTERPRETED else eager
        return eager
    # backend == "fused": the caller asked for it explicitly, so failing loudly beats a silent fallback.
    if not triton_available():
        raise ValueError("backend='fused' needs the 'triton' package; install the dev extra or use backend='auto'")
    if not fused_ok_dtype:
        raise ValueError(f"backend='fused' takes fp32 or bf16 streams, got {x.dtype}; use backend='reference'")
    fused = _fused_module()
    _warn_if_interpreted_on_cuda(fused)
    if x.is_cuda and fused.INTERPRETED:
        raise ValueError("backend='fused' on CUDA, but kernels.fused was imported under TRITON_INTERPRET=1; "
                         "unset it before the first import")
    if not x.is_cuda and not (fused.INTERPRETED and _interpret_env()):
        raise ValueError("backend='fused' on a CPU tensor needs TRITON_INTERPRET=1, set before kernels.fused is "
                         "first imported and while the kernels run; or move the tensors to CUDA, or use "
                         "backend='auto'/'reference'")
    return fused
