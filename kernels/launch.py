"""Launch configuration of the fused mHC kernels: every tile size, split count and dot precision as a pure
function of the shapes and the device's SM count. `gpu_config` is the production (compiled) choice,
`interpreter_config` the Triton interpreter's default; `use_config` lets tests and benchmarks run the GPU choice
under the interpreter. kernels.fused launches with `launch_config`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch
import triton


def np2(v: int) -> int:
    return triton.next_power_of_2(max(int(v), 1))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1



@dataclass(frozen=True)
class ProjectTiles:
    """One launch of a projection kernel. Grid = (grid[0], split): the forward splits K into `split` slices of
    `per_split` columns, the backward splits R into `split` slices of `per_split` rows; each slice writes its own
    fp32 partial sum (mix/sumsq forward, dphi backward) and the caller reduces them (deterministic, no atomics)."""

    block_r: int
    block_k: int
    block_m: int
    split: int
    per_split: int
    precision: str  # tl.dot input_precision: "tf32" (bf16 streams on GPU) or "ieee"
    grid: tuple[int, int]


@dataclass(frozen=True)
class ApplyTiles:
    """Pre read / post+res write: each program owns block_t tokens and block_c channels (forward grid
    [cdiv(T, block_t), cdiv(C, block_c)]; the backward walks C in block_c steps, grid [cdiv(T, block_t)])."""

    block_t: int
    block_c: int


@dataclass(frozen=True)
class CoeffTiles:
    """Coefficient kernels: block_t tokens per program; the backward writes one dalpha/dbias partial sum per
    program (`grid` of them), reduced by the caller."""

    block_t: int
    grid: int


@dataclass(frozen=True)
class LaunchConfig:
    """Every tile size, split count and dot precision of the fused kernels, as pure functions of the shapes.

    kind "gpu" is the production choice (`gpu_config(num_sms)`): split-K projection forward and split-R
    backward sized to fill 2 programs per SM, TF32 dots for bf16 streams, 1024-element apply tiles, 32-token
    coefficient programs. kind "interpreter" (`interpreter_config()`) is what the Triton interpreter runs by
    default: it pays per program and per op, not per element, so it gets one large tile per test shape and no
    splits. Tests and benchmarks run the GPU choice under the interpreter with `use_config("gpu", num_sms=...)`.
    """

    kind: Literal["gpu", "interpreter"]
    num_sms: int = 1

    def __post_init__(self):
        if self.kind not in ("gpu", "interpreter"):
            raise ValueError(f"LaunchConfig kind={self.kind!r} is unknown; choose 'gpu' or 'interpreter'")
        if int(self.num_sms) < 1:
            raise ValueError(f"num_sms={self.num_sms} must be >= 1")

    @property
    def gpu(self) -> bool:
        return self.kind == "gpu"

    def precision(self, dtype: torch.dtype) -> str:
        # mhc.md §2.2 pins a TF32 projection for bf16 streams; fp32 streams keep full precision. The Triton
        # interpreter accepts "tf32" but computes the dot in full fp32 (it does not round the operands).
        return "tf32" if (self.gpu and dtype == torch.bfloat16) else "ieee"

    def _split(self, length: int, block: int, other_programs: int) -> tuple[int, int]:
        """(slices, elements per slice) of a reduction over `length` in `block`-sized blocks, beside
        `other_programs` programs: on the GPU enough slices for 2 programs per SM, one under the interpreter."""
        blocks = triton.cdiv(length, block)
        split = max(1, min(blocks, triton.cdiv(2 * self.num_sms, other_programs))) if self.gpu else 1
        per_split = triton.cdiv(blocks, split) * block
        return triton.cdiv(length, per_split), per_split

    def project_fwd(self, r: int, k: int, m: int, dtype: torch.dtype) -> ProjectTiles:
        """mix = A[r, k] @ phi[k, m]: split K so a short T still fills the GPU."""
        block_r, block_m = 32, max(16, np2(m))
        block_k = 128 if self.gpu else 256
        grid_r = triton.cdiv(r, block_r)
        split, per_split = self._split(k, block_k, grid_r)
        return ProjectTiles(block_r, block_k, block_m, split, per_split, self.precision(dtype), (grid_r, split))

    def project_bwd(self, r: int, k: int, m: int, dtype: torch.dtype) -> ProjectTiles:
        """dA and dphi = A^T dmix: programs over K blocks, rows split so a narrow K still fills the GPU."""
        block_r, block_m = 32, max(16, np2(m))
        block_k = 64 if self.gpu else 256
        k_blocks = triton.cdiv(k, block_k)
        split, per_split = self._split(r, block_r, k_blocks)
        return ProjectTiles(block_r, block_k, block_m, split, per_split, self.precision(dtype), (k_blocks, split))

    def apply(self, c: int, n: int) -> ApplyTiles:
        np_ = np2(n)
        if not self.gpu:
            return ApplyTiles(64, min(np2(c), 512))
        block_c = min(np2(c), 256)
        return ApplyTiles(max(2, 1024 // (np_ * block_c)), block_c)

    def coeffs(self, t: int) -> CoeffTiles:
        # The interpreter's cost is per program and op, so one program covers all tokens of a test shape.
        block_t = 32 if self.gpu else min(512, max(16, np2(t)))
        return CoeffTiles(block_t, triton.cdiv(t, block_t))


def gpu_config(num_sms: int) -> LaunchConfig:
    """The production (compiled) choice for a device with num_sms streaming multiprocessors (H200: 132)."""
    return LaunchConfig("gpu", int(num_sms))


def interpreter_config() -> LaunchConfig:
    """The Triton interpreter's default: large tiles, no splits, full-precision dots."""
    return LaunchConfig("interpreter")


# Test/benchmark override set by use_config: None, or (kind, num_sms or None = the device's SM count).
# A plain module global, not a ContextVar: autograd runs CUDA backward nodes on its own worker thread.
_OVERRIDE: tuple[str, int | None] | None = None


@contextlib.contextmanager
def use_config(kind: Literal["gpu", "interpreter"], num_sms: int | None = None):
    """Tests and benchmarks only: launch the fused ops with the "gpu" or "interpreter" choice whatever runs
    them, e.g. `with use_config("gpu", num_sms=16):` runs the exact GPU tiles, split-K/split-R partial sums and
    multi-program dalpha/dbias reductions under the interpreter (a small fake SM count makes split > 1 happen
    at small shapes). num_sms=None takes the device's SM count (CUDA tensors only). An autograd node keeps the
    choice made at its forward for its backward. Process-wide while active: not for concurrent use."""
    global _OVERRIDE
    LaunchConfig(kind, 1 if num_sms is None else num_sms)  # validate now, not at the first launch
    prev, _OVERRIDE = _OVERRIDE, (kind, None if num_sms is None else int(num_sms))
    try:
        yield
    finally:
        _OVERRIDE = prev


def launch_config(device: torch.device, interpreted: bool) -> LaunchConfig:
    """The configuration the fused ops launch with on `device`: the use_config override when one is active,
    else the interpreter's choice when the kernels were built for it (`interpreted`), else gpu_config(SM count)."""
    if _OVERRIDE is None:
        return interpreter_config() if interpreted else gpu_config(_num_sms(device))
    kind, sms = _OVERRIDE
    if kind == "interpreter":
        return interpreter_config()
    if sms is None:
        if device.type != "cuda":
            raise ValueError("use_config('gpu') on a non-CUDA tensor needs num_sms= (there is no SM count to read)")
        sms = _num_sms(device)
    return gpu_config(sms)
