"""Hardware specs: peak rates from vendor datasheets, size-dependent efficiency curves (Calculon-style), links.

A kernel's time is a roofline with efficiencies (costmodel.md §2.1):

    t = max(FLOPs / (peak * eta_c(FLOPs)), bytes / (hbm_bw * eta_m(bytes))) + t_launch

`eta_c` and `eta_m` are piecewise-linear over op size (Calculon `systems/*.json`: matrix and vector curves over
GFLOP, memory curve over MB; linear interpolation between points, flat outside). One curve per op class:
tensor-core matmul, vector/elementwise, memory copy.

Flat extrapolation is silent inside `Curve.coverage()`: from the first point (Calculon's curves start at size 0,
their near-empty-op anchor) up to the last point times the span of the non-zero points (in log size: a
saturating curve is trusted as far again beyond its last point as its points reach; Calculon's memory curve,
1..100 MB, up to 10 GB). A lookup outside (below a first point that is not 0, or beyond that bound) is
recorded by `CurveLookups` (one per Pricer) and reported as one aggregated line per curve in the prediction's
warnings (`curve_warnings`). A constant curve (points only at size 0) claims no size dependence and never warns.

Sources of the numbers (all dense, no sparsity):
* `peak_flops["tf32"]` prices fp32-input GEMMs on tensor cores (mHC's Eq. 14-15 projection: phi is TF32-rounded,
  mHC Eq. 10-13, TK `round_to_tf32`, DeepGEMM `tf32_hc_prenorm_gemm`). A spec without a tf32 rate (`local`: a CPU
  has no TF32 unit, it runs such a GEMM in fp32) falls back to its fp32 rate.
* H800 SXM5: bf16 989.4 TFLOP/s, tf32 494.7, fp32 66.9 (same SXM5 die as H100); HBM3 80 GB at 3.35 TB/s;
  NVLink 400 GB/s bidirectional = 200 GB/s per direction, of which DeepSeek-V3 (arXiv 2412.19437 §3.2.2)
  reports ~160 GB/s achievable (efficiency 0.8); InfiniBand 400 Gb/s = 50 GB/s per GPU (same section).
* FP8 (train.fp8): Hopper (H800, H100, H200) 1,978.9 TFLOP/s dense (the H100 datasheet's 3,958 with sparsity,
  halved); B200 4.5 PFLOP/s dense (72 PF sparse per HGX board / 8 / 2); the A100 has no FP8 tensor cores (no rate:
  an FP8 run on it is refused). FP8 GEMMs have their own curve (`fp8_matrix_eff`), not the bf16 ceiling: DeepGEMM's
  release table (github.com/deepseek-ai/DeepGEMM README, H800, NVCC 12.8) gives its grouped contiguous GEMMs at V3's
  training shapes (4-8 groups of 4,096-8,192 tokens, N x K = 4096 x 7168 and 7168 x 2048) 1,093-1,297 TFLOP/s,
  0.55-0.66 of 1,978.9; dense M = 4,096: 590-1,358. The Hopper fp8 curve is Calculon's shape with its top at
  1,297 / 1,978.9 = 0.655 (the best V3 training shape: a ceiling, not a mean; DeepGEMM reached up to 1,550 = 0.78
  on some shapes after 2025-04, which V3's run did not have).
* Attention core: its own curves (`attention_fwd_eff`, `attention_bwd_eff`): FlashAttention-3 (Shah et al. 2024,
  arXiv 2407.08608, "Attention forward/backward speed, head dim 128, H100 80GB SXM5") at sequence 4k: forward 638,
  backward 542 TFLOP/s = 0.645 / 0.548 of 989.4 (bf16): the Hopper attention curves have those tops. The A100
  keeps its matrix curve for both (None: FlashAttention-2 on A100 reaches the GEMM-class ~0.7 of peak).
* H100 SXM5 (NVIDIA H100 datasheet): bf16 989.4, tf32 494.7, fp32 66.9 TFLOP/s; 80 GB HBM3 3.35 TB/s; NVLink 4
  900 GB/s bidirectional = 450 GB/s per direction; 132 SMs.
* H200 SXM (NVIDIA H200 datasheet): same compute as H100; 141 GB HBM3e at 4.8 TB/s; NVLink 900 GB/s.
  Measured on the project's H200 (gpu.md §3): bf16 8192^3 GEMM ~790 TFLOP/s (eta 0.80) and device copy ~4.3 TB/s
  (eta 0.90): these are the ceilings of the Hopper curves below.
* B200 (NVIDIA HGX B200 datasheet, per GPU = 1/8 of the HGX board): bf16 2.25 PFLOP/s dense (36 PF sparse / 8 / 2),
  tf32 1.1 PFLOP/s dense, fp32 75 TFLOP/s; 180 GB HBM3e at 8 TB/s; NVLink 5 1.8 TB/s bidirectional = 900 GB/s
  per direction; 148 SMs; ConnectX-7 400 Gb/s per GPU.
* A100 SXM 80GB (NVIDIA A100 datasheet): bf16 312, tf32 156, fp32 19.5 TFLOP/s; HBM2e 2.039 TB/s; NVLink 3
  600 GB/s bidirectional = 300 GB/s per direction; 108 SMs; DGX A100: one 200 Gb/s HDR NIC per GPU = 25 GB/s.
* Curves: Calculon `systems/a100_80g.json` / `h100_80g_nvl8.json` (calculon-ai/calculon): matrix
  {0: 0.1, 1: 0.6, 16: 0.9, 128: 0.95} over GFLOP, vector {0: 0.1, 1: 0.5, 16: 0.95}, HBM {0: 0.3, 1: 0.6,
  10: 0.75, 100: 0.9} over MB. For Hopper/Blackwell the matrix curve is scaled so its top is the measured 0.80
  (Calculon's 0.95 was tuned on A100 and is not reached by cuBLAS on H200, gpu.md).
* Links: Calculon latencies 1 us (NVLink) and 2 us (IB) and IB efficiency 0.9; NVLink efficiency 0.6 on
  H100/H200/B200/A100 (Calculon), 0.8 on H800 (DeepSeek-V3's 160 of 200 GB/s).
* Communication SM carve-out: DeepSeek-V3 (arXiv 2412.19437 §3.2.2) gives 20 of 132 H800 SMs to its all-to-all
  kernels, DeepEP's default `num_sms` is 20: while an all-to-all runs, compute runs on sms - comm_sms SMs, i.e. a
  compute-bound kernel takes 132/112 = 1.18x as long (not +15%). `interference` (sigma) is extra slowdown beyond
  that (HBM and L2 contention), 0 by default: the optimistic bound, labelled as such in reports.
* bandwidth_sm_share 0.35: the share of SMs a memory-bound kernel needs to reach its bandwidth (an assumption:
  Hopper copy kernels saturate HBM with roughly a third of the SMs resident); it is what an mHC kernel on the
  high-priority stream takes from a co-running GEMM (overlap.py). A sensitivity input, not a measured number.
* Kernel issue gap (t_launch) 2 us per GPU kernel: an assumption (typical back-to-back CUDA kernel gap without
  graphs); calibrate it from tiny kernels on the target (costmodel.md §3). `local` measures its own.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from costmodel.physics.runtime_profile import RuntimeProfile

PROFILE_DIR = Path(__file__).resolve().parents[1] / "runs" / "hardware"
GB = 1e9
TB = 1e12
MB = 1e6
GFLOP = 1e9
GIB = 2**30  # "80 GB" HBM parts expose ~80 GiB (H100 80GB: 81559 MiB; H200: 143771 MiB ~ 140 GiB)


class Curve(BaseModel):
    """Piecewise-linear efficiency over op size (size unit in `unit`), flat beyond the end points."""

    model_config = ConfigDict(extra="forbid")
    unit: Literal["GFLOP", "MB"] = "GFLOP"
    points: list[tuple[float, float]] = Field(min_length=1, description="(size, efficiency), ascending size")

    @pydantic.field_validator("points")
    @classmethod
    def _sorted(cls, pts: list[tuple[float, float]]) -> list[tuple[float, float]]:
        pts = sorted((float(s), float(e)) for s, e in pts)
        for s, e in pts:
            if not 0 < e <= 1.0 + 1e-9 or s < 0:
                raise ValueError(f"efficiency point ({s}, {e}): need size >= 0 and 0 < efficiency <= 1")
        return pts

    def __call__(self, size: float) -> float:
        pts = self.points
        if size <= pts[0][0]:
            return pts[0][1]
        for (s0, e0), (s1, e1) in zip(pts, pts[1:]):
            if size <= s1:
                return e0 + (e1 - e0) * (size - s0) / (s1 - s0)
        return pts[-1][1]

    def coverage(self) -> tuple[float, float]:
        """(lo, hi) sizes the curve vouches for (module docstring): lo its first point, hi its last point times
        the span last / first of its non-zero points; (0, inf) for a constant curve (points only at size 0)."""
        nonzero = [s for s, _ in self.points if s > 0]
        if not nonzero:
            return 0.0, math.inf
        return self.points[0][0], nonzero[-1] * (nonzero[-1] / nonzero[0])

    def outside(self, size: float) -> bool:
        """Whether a lookup at `size` is a flat extrapolation beyond `coverage()`."""
        lo, hi = self.coverage()
        return size < lo or size > hi

    def scaled(self, top: float) -> "Curve":
        """The same shape with its largest efficiency set to `top`."""
        peak = max(e for _, e in self.points)
        return Curve(unit=self.unit, points=[(s, e * top / peak) for s, e in self.points])


class Link(BaseModel):
    """One fabric, alpha-beta: t = latency + bytes / (bandwidth * efficiency). Bandwidth per direction."""

    model_config = ConfigDict(extra="forbid")
    name: str
    bandwidth: float = Field(gt=0, description="bytes/s per direction per GPU")
    latency_us: float = Field(ge=0, description="alpha in microseconds")
    efficiency: float = Field(1.0, gt=0, le=1.0, description="achievable fraction of `bandwidth` for large messages")

    def time_us(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        return self.latency_us + nbytes / (self.bandwidth * self.efficiency) * 1e6

    def with_bandwidth(self, bandwidth: float) -> "Link":
        return self.model_copy(update={"bandwidth": bandwidth})


class MemoryReserve(BaseModel):
    """What a GPU holds besides model states, activations and buffers (costmodel/physics/memory.py states each term's
    source): stated assumptions, not measured here, so `--sensitivity` moves them."""

    model_config = ConfigDict(extra="forbid")
    cuda_context_bytes: float = Field(0.75 * GIB, ge=0, description="the CUDA context of a PyTorch process")
    nccl_bytes: float = Field(0.5 * GIB, ge=0, description="NCCL buffers of all of a rank's communicators")
    deepep_nvl_bytes: float = Field(2e9, ge=0, description="DeepEP's NVLink buffer (EP > 1)")
    deepep_rdma_bytes: float = Field(1e9, ge=0, description="DeepEP's RDMA buffer (an EP group over nodes)")
    fragmentation: float = Field(0.05, ge=0, lt=1, description="allocator fragmentation, a share of the "
                                 "dynamically allocated bytes")


class HardwareSpec(BaseModel):
    """One accelerator model (or this machine, `local`). Rates in FLOP/s and bytes/s; times in microseconds."""

    model_config = ConfigDict(extra="forbid")
    name: str
    description: str = ""
    peak_flops: dict[str, float] = Field(description="dense tensor-core FLOP/s by dtype: bf16, tf32, fp32")
    vector_flops: float = Field(gt=0, description="non-tensor (CUDA-core) FLOP/s for elementwise math")
    hbm_bandwidth: float = Field(gt=0, description="memory bandwidth, bytes/s")
    memory_bytes: float = Field(gt=0, description="device memory capacity, bytes")
    sms: int = Field(1, ge=1, description="streaming multiprocessors (cores for `local`)")
    matrix_eff: Curve
    vector_eff: Curve
    memory_eff: Curve
    fp8_matrix_eff: Curve | None = Field(None, description="efficiency curve of FP8 GEMMs (train.fp8: DeepGEMM-class "
                                         "kernels with fine-grained scaling); None = matrix_eff")
    attention_fwd_eff: Curve | None = Field(None, description="efficiency curve of the attention core's forward "
                                            "(FlashAttention-class); None = matrix_eff")
    attention_bwd_eff: Curve | None = Field(None, description="efficiency curve of the attention core's backward; "
                                            "None = matrix_eff")
    mhc_memory_eff: Curve | None = Field(None, description="efficiency curve of the mHC kernels' HBM traffic (groups "
                                         "mhc and recompute: TileLang, Triton and cuTile kernels differ by up to "
                                         "~2x); None = memory_eff")
    launch_us: float = Field(2.0, ge=0, description="per-kernel issue gap, forward (us)")
    bwd_launch_us: float | None = Field(None, ge=0, description="per-kernel cost in backward; default launch_us")
    intra: Link = Field(description="intra-node P2P (NVLink / shared memory)")
    inter: Link = Field(description="inter-node P2P (InfiniBand / network)")
    gpus_per_node: int = Field(8, ge=1)
    interference: float = Field(0.0, ge=0, description="sigma: extra compute slowdown while an all-to-all runs under "
                                "it, beyond the comm_sms carve-out (0 = the carve-out only, the optimistic bound)")
    comm_sms: int = Field(0, ge=0, description="SMs the communication kernels occupy while an all-to-all runs: "
                          "compute on the other streams gets sms - comm_sms of them (DeepEP's default 20)")
    bandwidth_sm_share: float = Field(0.35, gt=0, le=1, description="share of the SMs a memory-bound kernel needs "
                                      "to draw its full HBM bandwidth (what it takes from a co-running GEMM)")
    attention_bwd_factor: float = Field(2.5, gt=0, description="attention core backward FLOPs over its forward "
                                        "(FlashAttention-2: five matmuls against two; costmodel/physics/ops.py)")
    reserve: MemoryReserve = Field(default_factory=MemoryReserve, description="memory a GPU holds besides the "
                                   "run's tensors (costmodel/physics/memory.py); unused on a CPU spec")
    host_cores: int | None = Field(None, description="`local` only: ranks share this many CPU cores")
    runtime: RuntimeProfile | None = Field(None, description="`local` only: this runtime's per-action calibration "
                                                             "for one shape (costmodel.local)")
    meta: dict = Field(default_factory=dict, description="source, calibration date, versions...")

    @pydantic.field_validator("peak_flops")
    @classmethod
    def _positive_peaks(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {k: r for k, r in v.items() if not (math.isfinite(r) and r > 0)}
        if bad:
            raise ValueError(f"peak FLOP/s must be finite and > 0, got {bad} (e.g. \"bf16\": 9.894e14)")
        return v

    # ---- kernel pricing -----------------------------------------------------------------------------
    def peak(self, dtype: str) -> float:
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        if dtype in ("float32", "fp32", "tf32"):  # no tf32 rate (a CPU): a TF32-rounded GEMM runs in fp32
            return self.peak_flops.get("fp32", self.vector_flops)
        if dtype in ("bfloat16", "bf16", "float16", "fp16"):
            return self.peak_flops.get("bf16", self.vector_flops)
        raise ValueError(f"{self.name}: no peak rate for dtype {dtype!r}; known {', '.join(self.peak_flops)}")

    def matrix_curve(self, dtype: str = "bf16", op: str = "gemm") -> Curve:
        """The efficiency curve a tensor-core kernel runs on: the attention core's forward/backward curve (`op`
        attn_fwd / attn_bwd), an FP8 GEMM's (dtype fp8), else the matrix curve; each falls back to matrix_eff."""
        own = {"attn_fwd": self.attention_fwd_eff, "attn_bwd": self.attention_bwd_eff}.get(op)
        if own is None and dtype == "fp8":
            own = self.fp8_matrix_eff
        return self.matrix_eff if own is None else own

    def matmul_compute_us(self, flops: float, dtype: str = "bf16", op: str = "gemm") -> float:
        """The compute side of a tensor-core kernel's roofline (us)."""
        if flops <= 0:
            return 0.0
        return flops / (self.peak(dtype) * self.matrix_curve(dtype, op)(flops / GFLOP)) * 1e6

    def matmul_us(self, flops: float, nbytes: float, dtype: str = "bf16", mhc: bool = False, op: str = "gemm") -> float:
        """Tensor-core GEMM (or attention core, `op`): roofline of its efficiency curve and memory, without launch."""
        return max(self.matmul_compute_us(flops, dtype, op), self.memory_us(nbytes, mhc))

    def vector_us(self, flops: float, nbytes: float, mhc: bool = False) -> float:
        """Elementwise / reduction kernel: vector-unit curve vs memory curve, without launch."""
        t_c = flops / (self.vector_flops * self.vector_eff(flops / GFLOP)) * 1e6 if flops > 0 else 0.0
        return max(t_c, self.memory_us(nbytes, mhc))

    def memory_us(self, nbytes: float, mhc: bool = False) -> float:
        """Time to move `nbytes` through HBM; `mhc`: an mHC kernel, at `mhc_memory_eff` when the spec has one."""
        if nbytes <= 0:
            return 0.0
        curve = self.mhc_memory_eff if (mhc and self.mhc_memory_eff is not None) else self.memory_eff
        return nbytes / (self.hbm_bandwidth * curve(nbytes / MB)) * 1e6

    def curve_sizes(self, cls: str, flops: float, nbytes: float) -> list[tuple[str, float]]:
        """(curve, size in the curve's unit) of every efficiency lookup that pricing a kernel of class `cls`
        makes (matmul_us / vector_us / memory_us): the lookups CurveLookups checks."""
        out = []
        if flops > 0 and cls in ("matrix", "vector"):
            out.append((cls, flops / GFLOP))
        if nbytes > 0 and cls in ("matrix", "vector", "memory"):
            out.append(("memory", nbytes / MB))
        return out

    def curve(self, name: str) -> Curve:
        return {"matrix": self.matrix_eff, "vector": self.vector_eff, "memory": self.memory_eff}[name]

    @property
    def backward_launch_us(self) -> float:
        return self.launch_us if self.bwd_launch_us is None else self.bwd_launch_us

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.model_dump(), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "HardwareSpec":
        path = Path(path)
        try:
            return cls.model_validate_json(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"{path}: no such hardware profile") from None
        except pydantic.ValidationError as err:
            first = err.errors()[0]
            where = ".".join(map(str, first["loc"])) or "file"
            if first["type"] == "json_invalid":
                raise ValueError(f"{path}: not valid JSON ({first['msg']}); a hardware profile is what "
                                 "HardwareSpec.save writes (see runs/hardware/local.json)") from None
            fix = ("; the runtime part comes from another version of the calibration: recalibrate (`mhcpipe demo` "
                   "or bench/predict_local.py)") if where.startswith("runtime") else ""
            raise ValueError(f"{path}: {where}: {first['msg']}{fix}") from None


class CurveLookups:
    """Efficiency-curve lookups outside a curve's coverage, collected while one Pricer prices its kernels (no
    global state: each Pricer owns one; `add` is called for every kernel it prices)."""

    def __init__(self, hw: HardwareSpec):
        self.hw = hw
        self.hits: dict[str, dict[str, tuple[float, float]]] = {}  # curve -> kernel name -> (min, max) size

    def add(self, name: str, cls: str, flops: float, nbytes: float) -> None:
        for curve, size in self.hw.curve_sizes(cls, flops, nbytes):
            if self.hw.curve(curve).outside(size):
                lo, hi = self.hits.setdefault(curve, {}).get(name, (size, size))
                self.hits[curve][name] = (min(lo, size), max(hi, size))


def curve_warnings(lookups) -> list[str]:
    """One line per curve for the out-of-coverage lookups of several CurveLookups (those of one prediction's
    pricers, which share a hardware spec; None entries are skipped): which curve, which size range, which
    kernels, and the flat efficiency they were priced at."""
    merged: dict[str, dict[str, tuple[float, float]]] = {}
    hw = None
    for lk in lookups:
        if lk is None:
            continue
        hw = lk.hw
        for curve, kernels in lk.hits.items():
            for name, (lo, hi) in kernels.items():
                a, b = merged.setdefault(curve, {}).get(name, (lo, hi))
                merged[curve][name] = (min(a, lo), max(b, hi))
    lines = []
    for curve in sorted(merged):
        c = hw.curve(curve)
        lo_ok, hi_ok = c.coverage()
        kernels = merged[curve]
        parts = []
        below = sorted(n for n, (lo, _) in kernels.items() if lo < lo_ok)
        above = sorted(n for n, (_, hi) in kernels.items() if hi > hi_ok)
        if below:
            lo, hi = min(kernels[n][0] for n in below), min(lo_ok, max(kernels[n][1] for n in below))
            parts.append(f"{len(below)} kernel(s) at {lo:.3g}-{hi:.3g} {c.unit}, below its first point "
                         f"{lo_ok:.3g} {c.unit}, at its first efficiency {c.points[0][1]:.2f} "
                         f"({', '.join(below[:6])}{', ...' if len(below) > 6 else ''})")
        if above:
            lo, hi = max(hi_ok, min(kernels[n][0] for n in above)), max(kernels[n][1] for n in above)
            parts.append(f"{len(above)} kernel(s) at {lo:.3g}-{hi:.3g} {c.unit}, beyond the {hi_ok:.3g} {c.unit} "
                         f"its points cover, at its last efficiency {c.points[-1][1]:.2f} "
                         f"({', '.join(above[:6])}{', ...' if len(above) > 6 else ''})")
        lines.append(f"{hw.name} {curve} efficiency curve extrapolated flat: {'; '.join(parts)}; calibrate the curve "
                     f"over these sizes (`mhcpipe calibrate`) for a trustworthy price")
    return lines


# ---- curves (Calculon, see module docstring) --------------------------------------------------------------
CALCULON_MATRIX = Curve(unit="GFLOP", points=[(0, 0.1), (1, 0.6), (16, 0.9), (128, 0.95)])
CALCULON_VECTOR = Curve(unit="GFLOP", points=[(0, 0.1), (1, 0.5), (16, 0.95)])
CALCULON_HBM = Curve(unit="MB", points=[(0, 0.3), (1, 0.6), (10, 0.75), (100, 0.9)])
HOPPER_MATRIX = CALCULON_MATRIX.scaled(790 / 989.4)  # measured H200 GEMM ceiling (gpu.md §3)
HOPPER_HBM = CALCULON_HBM.scaled(4.3 / 4.8)  # measured H200 copy ceiling (gpu.md §3), ~0.90 as Calculon's
HOPPER_FP8 = CALCULON_MATRIX.scaled(1297 / 1978.9)  # DeepGEMM's best V3 training shape on H800 (module docstring)
HOPPER_ATTN_FWD = CALCULON_MATRIX.scaled(638 / 989.4)  # FlashAttention-3, head dim 128, 4k (module docstring)
HOPPER_ATTN_BWD = CALCULON_MATRIX.scaled(542 / 989.4)

IB_400G = Link(name="InfiniBand NDR 400Gb/s", bandwidth=50 * GB, latency_us=2.0, efficiency=0.9)


def _nvlink(bidirectional_gbs: float, efficiency: float) -> Link:
    return Link(name=f"NVLink {bidirectional_gbs:g} GB/s", bandwidth=bidirectional_gbs / 2 * GB, latency_us=1.0,
                efficiency=efficiency)


def _hopper(name: str, description: str, hbm_tbs: float, mem_gb: float, nvlink_gbs: float, nvlink_eff: float):
    return HardwareSpec(
        name=name, description=description,
        peak_flops={"fp8": 1978.9e12, "bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}, vector_flops=66.9e12,
        hbm_bandwidth=hbm_tbs * TB, memory_bytes=mem_gb * GIB, sms=132, comm_sms=20,
        matrix_eff=HOPPER_MATRIX, vector_eff=CALCULON_VECTOR, memory_eff=HOPPER_HBM, fp8_matrix_eff=HOPPER_FP8,
        attention_fwd_eff=HOPPER_ATTN_FWD, attention_bwd_eff=HOPPER_ATTN_BWD,
        intra=_nvlink(nvlink_gbs, nvlink_eff), inter=IB_400G, meta={"source": "vendor datasheets, see hardware.py"})


BUILTIN: dict[str, HardwareSpec] = {
    "h800": _hopper("h800", "NVIDIA H800 SXM5 80GB, NVLink 400 GB/s, IB 400 Gb/s per GPU", 3.35, 80, 400, 0.8),
    "h100": _hopper("h100", "NVIDIA H100 SXM5 80GB, NVLink 900 GB/s, IB 400 Gb/s per GPU", 3.35, 80, 900, 0.6),
    "h200": _hopper("h200", "NVIDIA H200 SXM 141GB, NVLink 900 GB/s, IB 400 Gb/s per GPU", 4.8, 140, 900, 0.6),
    "b200": HardwareSpec(
        name="b200", description="NVIDIA B200 (HGX) 180GB, NVLink 1.8 TB/s, IB 400 Gb/s per GPU",
        peak_flops={"fp8": 4.5e15, "bf16": 2.25e15, "tf32": 1.1e15, "fp32": 75e12}, vector_flops=75e12,
        hbm_bandwidth=8 * TB, memory_bytes=180 * GIB, sms=148, comm_sms=20,
        matrix_eff=HOPPER_MATRIX, vector_eff=CALCULON_VECTOR, memory_eff=HOPPER_HBM, fp8_matrix_eff=HOPPER_FP8,
        attention_fwd_eff=HOPPER_ATTN_FWD, attention_bwd_eff=HOPPER_ATTN_BWD,
        intra=_nvlink(1800, 0.6), inter=IB_400G, meta={"source": "HGX B200 datasheet; curves assumed Hopper-like"}),
    "a100": HardwareSpec(
        name="a100", description="NVIDIA A100 SXM 80GB, NVLink 600 GB/s, IB HDR 200 Gb/s per GPU",
        peak_flops={"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12}, vector_flops=19.5e12,
        hbm_bandwidth=2.039 * TB, memory_bytes=80 * GIB, sms=108, comm_sms=20,
        matrix_eff=CALCULON_MATRIX, vector_eff=CALCULON_VECTOR, memory_eff=CALCULON_HBM,
        intra=_nvlink(600, 0.6), inter=Link(name="InfiniBand HDR 200Gb/s", bandwidth=25 * GB, latency_us=2.0,
                                            efficiency=0.9),
        meta={"source": "A100 datasheet; Calculon a100_80g.json curves"}),
}


def local_profile_path() -> Path:
    """Where `local` lives: $MHCPIPE_LOCAL_PROFILE, else runs/hardware/local.json under the repository."""
    env = os.environ.get("MHCPIPE_LOCAL_PROFILE")
    return Path(env) if env else PROFILE_DIR / "local.json"


def hardware_names() -> list[str]:
    return sorted(BUILTIN) + ["local"]


def get_hardware(name: str | Path) -> HardwareSpec:
    """A built-in spec by name, `local` (the calibrated profile of this machine), or a profile JSON path."""
    key = str(name).lower()
    if key in BUILTIN:
        return BUILTIN[key]
    if key == "local":
        path = local_profile_path()
        if not path.exists():
            raise ValueError(f"hardware 'local' is not calibrated yet ({path} missing); run "
                             "`mhcpipe calibrate` (or bench/predict_local.py) first")
        return HardwareSpec.load(path)
    path = Path(str(name))
    if path.suffix == ".json":
        return HardwareSpec.load(path)
    raise ValueError(f"unknown hardware {str(name)!r}; choose one of {', '.join(hardware_names())} "
                     "or give a profile .json")
