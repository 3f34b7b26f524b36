"""Benchmark the mHC kernels (gpu.md §7): per-kernel time and GB/s against measured copy bandwidth, and
block-level fwd+bwd time of plain residual / mHC fused / mHC eager / mHC torch.compile. Writes JSON.

  python bench/kernel_bench.py                       # H200: C in {2560, 4096, 7168}, T=4096, n=4, bf16
  python bench/kernel_bench.py --device cpu --small  # smoke test: tiny shapes, fused kernels under the interpreter

Shape letters: T tokens, n streams, C hidden. Targets (issue): each fused kernel >= 70% of copy bandwidth
for T*C >= 1e7; block overhead of fused mHC at C=4096 <= 12%.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout that is not installed


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="tiny shapes (smoke test)")
    ap.add_argument("--hidden", type=int, nargs="*", default=None,
                    help="C values (default 2560 4096 7168; 64 with --small)")
    ap.add_argument("--tokens", type=int, default=None, help="T (default 4096; 32 with --small)")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (median reported)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile row")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/kernels_<dev>.json)")
    return ap.parse_args()


ARGS = parse_args()
if ARGS.device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of kernels.fused

import torch  # noqa: E402
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels import MHCConfig, MHCSublayer  # noqa: E402

MLP_HIDDEN = {2560: 6912, 4096: 11008, 7168: 18432}  # the probe's block shapes (gpu.md §6)


def timer(fn, device: str, reps: int, warmup: int) -> float:
    """Median seconds per call; CUDA events on GPU, perf_counter after a sync elsewhere."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: str, reps: int, nbytes: int) -> float:
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    sec = timer(lambda: dst.copy_(src), device, reps, 3)
    return 2 * nbytes / sec  # bytes read + written


def kernel_rows(t, n, c, dtype, device, reps, copy_bps):
    import kernels.fused as fz

    cfg = MHCConfig(n=n)
    m = cfg.num_mix
    es = torch.finfo(dtype).bits // 8
    g = torch.Generator(device=device).manual_seed(c)
    x = torch.randn(t, n, c, device=device, generator=g).to(dtype)
    y = torch.randn(t, c, device=device, generator=g).to(dtype)
    dout = torch.randn(t, n, c, device=device, generator=g).to(dtype)
    dlin = torch.randn(t, c, device=device, generator=g).to(dtype)
    phi = torch.randn(n * c, m, device=device, generator=g) / (n * c) ** 0.5
    alpha = torch.full((3,), 0.5, device=device)
    bias = torch.randn(m, device=device, generator=g)
    a = x.view(t, n * c)
    mix, ss = fz._project_fwd(a, phi)
    hp, hq, hr = fz._coeffs_fwd(mix, ss, alpha, bias, cfg, n * c)
    dmix, dss = torch.randn_like(mix), torch.randn_like(ss)
    dh = (torch.randn_like(hp), torch.randn_like(hq), torch.randn_like(hr))
    post = fz._PostRes
    coef = t * (2 * n + n * n) * 4
    cases = {
        # name: (callable, bytes moved: every input read once, every output written once)
        "project_fwd": (lambda: fz._project_fwd(a, phi), t * n * c * es + t * (m + 1) * 4),
        "project_bwd(+pre dx)": (lambda: fz._project_bwd(a, phi, dmix, dss, hp, dlin, n, c),
                                 2 * t * n * c * es + t * c * es + t * (m + 1 + n) * 4),
        "coeffs_sinkhorn_fwd": (lambda: fz._coeffs_fwd(mix, ss, alpha, bias, cfg, n * c), t * (m + 1) * 4 + coef),
        "coeffs_sinkhorn_bwd": (lambda: fz._coeffs_bwd(mix, ss, alpha, bias, *dh, cfg, n * c),
                                t * (m + 1) * 4 + 2 * coef),
        "pre_fwd": (lambda: fz._pre_fwd(x, hp), t * (n + 1) * c * es),
        "pre_bwd(dH only)": (lambda: fz._pre_bwd(x, hp, dlin, False), t * (n + 1) * c * es),
        "pre_bwd(dx+dH)": (lambda: fz._pre_bwd(x, hp, dlin, True), t * (2 * n + 1) * c * es),
        "post_res_fwd": (lambda: post.apply(x, y, hq, hr), t * (2 * n + 1) * c * es + coef),
        "post_res_bwd": (lambda: _post_bwd(post, x, y, hq, hr, dout), t * (3 * n + 2) * c * es + 2 * coef),
    }
    rows = []
    for name, (fn, nbytes) in cases.items():
        sec = timer(fn, device, reps, 2)
        rows.append(dict(kernel=name, T=t, n=n, C=c, dtype=str(dtype).split(".")[-1], ms=sec * 1e3,
                         bytes=nbytes, GBps=nbytes / sec / 1e9, frac_of_copy=nbytes / sec / copy_bps,
                         target_applies=t * c >= 1e7 and "coeffs" not in name))
    return rows


def _post_bwd(post, x, y, hq, hr, dout):
    # Time the backward kernel alone: call the Function's backward on a saved context.
    class Ctx:
        saved_tensors = (x, y, hq.float(), hr.float())
        dtypes = (hq.dtype, hr.dtype)

    return post.backward(Ctx, dout)


class Attention(nn.Module):
    def __init__(self, c, head_dim):
        super().__init__()
        self.norm, self.heads = nn.RMSNorm(c), c // head_dim
        self.qkv, self.out = nn.Linear(c, 3 * c, bias=False), nn.Linear(c, c, bias=False)

    def forward(self, u):
        t, c = u.shape
        q, k, v = self.qkv(self.norm(u)).view(t, 3, self.heads, c // self.heads).permute(1, 2, 0, 3)
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
        return self.out(o.transpose(0, 1).reshape(t, c))


class SwiGLU(nn.Module):
    def __init__(self, c, hidden):
        super().__init__()
        self.norm = nn.RMSNorm(c)
        self.w1, self.w3 = nn.Linear(c, hidden, bias=False), nn.Linear(c, hidden, bias=False)
        self.w2 = nn.Linear(hidden, c, bias=False)

    def forward(self, u):
        h = self.norm(u)
        return self.w2(F.silu(self.w1(h)) * self.w3(h))


def make_block(cfg: MHCConfig, c, mlp_hidden, head_dim, dtype, device):
    attn = Attention(c, head_dim).to(device=device, dtype=dtype)
    mlp = SwiGLU(c, mlp_hidden).to(device=device, dtype=dtype)
    # The mHC parameters (phi, alpha, bias) stay fp32 (mhc.md §2.2); only F is cast.
    return nn.Sequential(MHCSublayer(cfg, attn, c).to(device), MHCSublayer(cfg, mlp, c).to(device))


def block_rows(t, n, c, dtype, device, reps, compile_too):
    mlp_hidden = MLP_HIDDEN.get(c, 2 * c)
    head_dim = 128 if c % 128 == 0 and c >= 1024 else 32
    variants = [("plain residual", MHCConfig(variant="residual", n=1), False),
                ("mHC fused", MHCConfig(n=n, backend="fused"), False),
                ("mHC eager", MHCConfig(n=n, backend="reference"), False)]
    if compile_too:
        variants.append(("mHC torch.compile", MHCConfig(n=n, backend="reference"), True))
    rows, base = [], None
    for label, cfg, comp in variants:
        torch.manual_seed(0)
        block = make_block(cfg, c, mlp_hidden, head_dim, dtype, device)
        fn_block = torch.compile(block) if comp else block
        x = torch.randn(t, cfg.n, c, device=device, dtype=dtype, requires_grad=True)
        g = torch.randn(t, cfg.n, c, device=device, dtype=dtype)

        def step(fn_block=fn_block, x=x, g=g):  # bound now: the loop deletes them after timing
            fn_block(x).backward(g)

        row = dict(block=label, T=t, n=cfg.n, C=c, mlp_hidden=mlp_hidden, dtype=str(dtype).split(".")[-1])
        try:
            sec = timer(step, device, reps, 3)
            row["ms"] = sec * 1e3
            if device == "cuda":
                row["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30
        except Exception as exc:  # noqa: BLE001 - a failed compile must not hide the other rows
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        if label == "plain residual":
            base = row.get("ms")
        elif base and "ms" in row:
            row["overhead_pct"] = 100 * (row["ms"] / base - 1)
        rows.append(row)
        del block, fn_block, x, g
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    return rows


def main():
    args = ARGS
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu --small for a smoke test")
    small = args.small
    t = args.tokens or (32 if small else 4096)
    hidden = args.hidden or ([64] if small else [2560, 4096, 7168])
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    reps = args.reps or (2 if small else 20)
    copy_bps = copy_bandwidth(args.device, reps, (2**22 if small else 2**31))
    print(f"copy bandwidth ({args.device}): {copy_bps / 1e9:.1f} GB/s (read + write)")
    kernels_out, blocks_out = [], []
    for c in hidden:
        kernels_out += kernel_rows(t, args.n, c, dtype, args.device, reps, copy_bps)
        blocks_out += block_rows(t, args.n, c, dtype, args.device, max(2, reps // 2), not args.no_compile)
    print(f"\n{'kernel':<24}{'C':>6}{'ms':>10}{'GB/s':>10}{'% copy':>8}")
    for r in kernels_out:
        print(f"{r['kernel']:<24}{r['C']:>6}{r['ms']:>10.4f}{r['GBps']:>10.1f}{100 * r['frac_of_copy']:>8.1f}")
    print(f"\n{'block (fwd+bwd)':<20}{'C':>6}{'ms':>10}{'overhead':>10}")
    for r in blocks_out:
        ms = f"{r['ms']:.3f}" if "ms" in r else r.get("error", "")[:40]
        ov = f"{r['overhead_pct']:+.1f}%" if "overhead_pct" in r else ""
        print(f"{r['block']:<20}{r['C']:>6}{ms:>10}{ov:>10}")
    import triton

    result = dict(
        device=torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({platform.processor() or 'host'})",
        interpreter=os.environ.get("TRITON_INTERPRET") == "1", small=small, torch=torch.__version__,
        triton=triton.__version__, T=t, n=args.n, copy_GBps=copy_bps / 1e9, kernels=kernels_out, blocks=blocks_out,
        targets=dict(kernel_frac_of_copy=0.70, kernel_min_TC=1e7, block_overhead_pct_C4096=12.0),
        note="CPU runs use the Triton interpreter: a smoke test of the script, not a performance number.",
    )
    out = args.out or ROOT / "bench" / "results" / f"kernels_{args.device}{'_small' if small else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
