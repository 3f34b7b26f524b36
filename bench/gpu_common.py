"""What the GPU checks that compare two runs bit for bit share (bench/gpu_hp_check.py, bench/gpu_pair_check.py):
deterministic kernels and the device to run on."""
from __future__ import annotations

import os


def deterministic_mode(device_type: str, off: bool) -> list[str]:
    """CUDA: torch.use_deterministic_algorithms(True, warn_only=True) with CUBLAS_WORKSPACE_CONFIG set (before
    cuBLAS starts), so the comparison is not blurred by atomics (index_add/index_select backward of the MoE,
    attention backward); an op that has no deterministic form only warns. Returns the list that collects those
    warnings (reported in the JSON). CPU kernels are deterministic already: nothing changes there."""
    import warnings

    seen: list[str] = []
    if device_type != "cuda" or off:
        return seen
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if "determinis" in text and text[:200] not in seen:
            seen.append(text[:200])
        shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    return seen


def check_device(device_arg: str, script: str):
    """The torch device for --device (cuda:0, set current; or cpu), or None after a one-line error on stderr."""
    import sys

    import torch

    device = torch.device(device_arg, 0) if device_arg == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print(f"{script}: error: no CUDA device; use --device cpu --small", file=sys.stderr)
            return None
        torch.cuda.set_device(device)
    return device
