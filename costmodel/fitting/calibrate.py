"""Calibration: measure this machine (`local`) with short micro-benchmarks, or fit efficiencies from a trace.

`mhcpipe calibrate [--quick] [--threads N] [--no-p2p] [--device cpu|cuda] [-o PROFILE.json]` measures, with
torch on CPU
(or the current CUDA device with --device cuda):
* matmul rate over sizes (square fp32 GEMMs, 2n^3 FLOPs; on CUDA also bf16, 256 .. 8192, whose curve is kept):
  peak = the best rate; the matrix curve is the measured efficiency per size after removing the per-op launch
  cost (costmodel.md §3: median per bucket, made monotone); on CUDA the memory capacity and SM count are the
  device's, the P2P link is still the host's gloo (no NCCL measurement here);
* copy bandwidth over sizes (dst.copy_(src), read + write bytes): peak and the memory curve (on a CPU it falls
  with size once the working set leaves the caches; it is kept as measured, not made monotone);
* launch cost: a tiny op recorded by autograd (forward) and the per-node cost of autograd's backward;
* P2P between two local processes (gloo send/recv ping-pong, 4 KB .. 64 MB): alpha from the small messages,
  bandwidth from a least-squares fit of t = alpha + S / bw over all sizes;
* host cores: ranks of a local run share them (predict stretches compute by busy ranks / cores).
Warm-up runs are dropped; every point is the median of repeats. The result is a `HardwareSpec` named `local`,
saved as JSON (default runs/hardware/local.json, or $MHCPIPE_LOCAL_PROFILE).

`mhcpipe calibrate --from-trace TRACE --preset NAME|--config FILE [--hardware h200] [-o FILE.json]`
instead fits a spec's efficiency curves and launch gap to a measured baseline run of that config on the target
machine and saves the result as a hardware profile for `mhcpipe predict --hardware FILE.json`
(costmodel.fitting.trace_fit.fit_trace with costmodel.fitting.roofline_fit.RooflineFit).

Calibrating `local` for this project's own runtime and one config (micro-benchmarks of its stage and mHC
wrapper plus a baseline run) is `costmodel.local.calibration.calibrate_local_for`.
"""
from __future__ import annotations

import datetime
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from costmodel.physics.hardware import Curve, HardwareSpec, Link


def _median_time(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _monotone(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Running maximum over increasing size, clipped to (0, 1]."""
    out, best = [], 0.0
    for s, e in sorted(points):
        best = max(best, min(1.0, e))
        out.append((s, max(best, 1e-3)))
    return out


def measure_launch(repeats: int = 200) -> tuple[float, float]:
    """(forward op cost under autograd, backward cost per autograd node) in microseconds."""
    import torch

    x = torch.randn(4, requires_grad=True)
    chain = 50

    def fwd():
        y = x
        for _ in range(chain):
            y = y * 1.0001
        return y

    t_f = _median_time(fwd, max(5, repeats // 20)) / chain * 1e6

    def fwd_bwd():
        fwd().sum().backward()

    t_fb = _median_time(fwd_bwd, max(5, repeats // 20)) / chain * 1e6
    return t_f, max(t_fb - t_f, 0.1)


def _fit(rows: list[dict], size_key: str, scale: float, raw_us: float,
         monotone: bool = True) -> tuple[float, list[tuple[float, float]]]:
    """Peak rate (per second) and curve points (size/scale, efficiency) after removing the raw dispatch cost
    `raw_us` (the op without autograd); the peak comes from points well above that cost."""
    def rate(r: dict) -> float:
        return r[size_key] / max(r["us"] - raw_us, 0.2 * r["us"]) * 1e6

    solid = [r for r in rows if r["us"] > 10 * raw_us] or rows
    peak = max(rate(r) for r in solid)
    pts = [(r[size_key] / scale, rate(r) / peak) for r in rows]
    pts = [(0.0, pts[0][1])] + pts
    # memory: caches make small copies faster than DRAM, so the curve may fall with size; keep it as measured
    return peak, _monotone(pts) if monotone else [(s_, min(1.0, max(e, 1e-3))) for s_, e in pts]


def measure_raw_dispatch(device: str = "cpu") -> float:
    """Cost of one tiny op without autograd (us): removed from the sweeps before fitting curves."""
    import torch

    a = torch.randn(1, 1, device=device)
    return _median_time(lambda: torch.mm(a, a), 200) * 1e6


def measure_matmul(sizes: list[int], repeats: int, launch_us: float, device: str = "cpu",
                   dtype: str = "float32") -> tuple[float, list[tuple[float, float]], list[dict]]:
    import torch

    dt = getattr(torch, dtype)
    rows = []
    for n in sizes:
        a, b = torch.randn(n, n, device=device, dtype=dt), torch.randn(n, n, device=device, dtype=dt)
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

        def f():
            torch.mm(a, b)
            sync()

        t = _median_time(f, repeats)
        rows.append({"n": n, "flops": 2.0 * n ** 3, "us": t * 1e6})
    peak, pts = _fit(rows, "flops", 1e9, launch_us)
    return peak, pts, rows


def measure_copy(sizes_bytes: list[int], repeats: int, launch_us: float,
                 device: str = "cpu") -> tuple[float, list[tuple[float, float]], list[dict]]:
    import torch

    rows = []
    for nb in sizes_bytes:
        src = torch.randn(max(1, nb // 4), device=device)
        dst = torch.empty_like(src)
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

        def f():
            dst.copy_(src)
            sync()

        t = _median_time(f, repeats)
        rows.append({"bytes": 2 * src.numel() * 4, "us": t * 1e6})
    peak, pts = _fit(rows, "bytes", 1e6, launch_us, monotone=False)
    return peak, pts, rows


def _p2p_worker(rank: int, init_file: str, sizes: list[int], repeats: int, out_file: str, threads: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    rows = []
    for nb in sizes:
        buf = torch.zeros(max(1, nb // 4))
        ts = []
        for i in range(repeats + 2):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if i >= 2:
                ts.append((time.perf_counter() - t0) / 2)
        rows.append({"bytes": buf.numel() * 4, "us": statistics.median(ts) * 1e6})
    if rank == 0:
        import json

        Path(out_file).write_text(json.dumps(rows))
    dist.destroy_process_group()
    # a spawned child finalizes the interpreter on return, which aborted pipeline ranks now and then after
    # destroy_process_group (pipeline/__main__.py): leave without it, everything is written
    os._exit(0)


def measure_p2p(sizes_bytes: list[int], repeats: int, threads: int = 1) -> tuple[float, float, list[dict]]:
    """(alpha us, bandwidth bytes/s, rows) from a 2-process gloo ping-pong."""
    import json

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="cm_p2p_") as tmp:
        init, out = os.path.join(tmp, "init"), os.path.join(tmp, "rows.json")
        mp.spawn(_p2p_worker, args=(init, sizes_bytes, repeats, out, threads), nprocs=2, join=True)
        rows = json.loads(Path(out).read_text())
    alpha = min(r["us"] for r in rows)
    # least squares t - alpha = S / bw over the sizes where bandwidth matters (>= 64 KB)
    big = [r for r in rows if r["bytes"] >= 65536] or rows
    num = sum(r["bytes"] * (r["us"] - alpha) for r in big)
    den = sum(r["bytes"] ** 2 for r in big)
    bw = den / num * 1e6 if num > 0 else max(r["bytes"] / r["us"] * 1e6 for r in rows)
    return alpha, bw, rows


def calibrate_local(quick: bool = False, threads: int = 1, p2p: bool = True, device: str = "cpu") -> HardwareSpec:
    import torch

    torch.set_num_threads(threads)
    reps = 5 if quick else 15
    launch_f, launch_b = measure_launch(100 if quick else 400)
    raw = measure_raw_dispatch(device)
    on_gpu = device == "cuda"
    if on_gpu:  # tensor cores reach their rate only at large shapes, and bf16 is what models train in
        mm_sizes = [256, 1024, 4096] if quick else [256, 512, 1024, 2048, 4096, 8192]
    else:
        mm_sizes = [16, 64, 256] if quick else [16, 32, 64, 128, 256, 512, 1024]
    peak, mcurve, mrows = measure_matmul(mm_sizes, reps, raw, device)
    peaks = {"fp32": peak, "bf16": peak}
    if on_gpu:
        peaks["bf16"], mcurve, brows = measure_matmul(mm_sizes, reps, raw, device, "bfloat16")
        mrows = [{**r, "dtype": "float32"} for r in mrows] + [{**r, "dtype": "bfloat16"} for r in brows]
    cp_sizes = [1 << 12, 1 << 20, 1 << 24] if quick else [1 << k for k in range(12, 28, 2)]
    bw, ccurve, crows = measure_copy(cp_sizes, reps, raw, device)
    if p2p:
        p_sizes = [1 << 12, 1 << 20] if quick else [1 << k for k in range(12, 27, 2)]
        alpha, pbw, prows = measure_p2p(p_sizes, 3 if quick else 10, threads)
    else:
        alpha, pbw, prows = 50.0, 1e9, []
    link = Link(name="local gloo (2 processes)", bandwidth=pbw, latency_us=alpha, efficiency=1.0)
    cores = os.cpu_count() or 1
    if on_gpu:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        memory, units = float(props.total_memory), props.multi_processor_count
    else:
        memory, units = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), cores
    return HardwareSpec(
        name="local", description=f"this machine ({platform.processor() or platform.machine()}, {cores} cores, "
                                  f"{threads} thread(s) per rank, {device})",
        peak_flops=peaks, vector_flops=peak / 8, hbm_bandwidth=bw, memory_bytes=memory, sms=units,
        matrix_eff=Curve(unit="GFLOP", points=mcurve), vector_eff=Curve(unit="GFLOP", points=[(0, 1.0)]),
        memory_eff=Curve(unit="MB", points=ccurve), launch_us=launch_f, bwd_launch_us=launch_b,
        intra=link, inter=link, gpus_per_node=64, interference=0.0,
        host_cores=cores if device == "cpu" else None,
        meta={"calibrated": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
              "threads": threads, "quick": quick, "raw_dispatch_us": raw, "matmul": mrows, "copy": crows, "p2p": prows,
              "python": platform.python_version()})
