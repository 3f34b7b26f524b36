"""Full-size correctness of the fused mHC kernels: forward and every gradient against the float64 reference.

    python bench/kernel_parity.py                         # GPU: T=4096, n=4, C in {2560, 4096, 7168}, bf16 + fp32
    python bench/kernel_parity.py --device cpu --small    # smoke test under the Triton interpreter
    python bench/kernel_parity.py --device cpu --small --launch gpu --num-sms 11   # ... with the GPU's tiles/splits

Shape letters: T tokens, n streams, C hidden, K = n*C the projection width. tests/kernels checks the same math
at small shapes (T <= 257, C <= 320; test_kernels_gpu_config.py in the GPU launch configuration); this runs it
at the shapes the benchmarks time. Method (gpu.md §7): fresh random inputs for every case (never zeros), a
random upstream gradient, F(u) = u * scale + y0 so the gradient also flows through pre; the reference runs in
float64 on the same already-rounded inputs; relative Frobenius error ||fused - ref|| / ||ref||; NaN never passes.
Both the separate ops and the combined pre side are checked. Exit 1 when any case fails; writes JSON.

Tolerances (TOLERANCES below), per stream dtype and output tensor:

    streams   tensors                                   compiled (CUDA)   interpreter
    fp32      all 11                                    1e-4              1e-4
    bf16      h_pre, h_post, h_res (fp32 coefficients)  1e-3              1e-3
    bf16      out, lin, dx, dphi, dalpha, dbias, ...    1e-2              2e-2

Why, for bf16 streams at K = n*C = 10,240 (C = 2560) with the TF32 projection (mhc.md §2.2). Unit roundoffs:
bf16 2^-9 (8 significant bits; relative spacing 2^-8 to 2^-7), TF32 2^-11 (10 explicit mantissa bits), fp32
2^-24. Tensor-wise relative errors of random data are RMS values, about ulp/sqrt(12) over the mantissa spread:
  1. bf16 inputs cost nothing here: the reference sees the same rounded x, and bf16 is exact in TF32 (8 <= 11
     significant bits), so only fp32 operands get rounded by the TF32 dots: phi (forward, dA), dmix (dA, dphi).
  2. TF32 operand rounding: per-product relative error e with RMS 2.1e-4 when rounded to nearest, 4.1e-4 when
     the tensor cores truncate the 13 low bits (the larger-error model; Triton passes fp32 registers). The
     error of mix = sum_k a_k phi_k (1 + e_k) is a random-sign sum of K terms, like mix itself, so both grow
     as sqrt(K) and the relative error is RMS(e), independent of K: 2.0e-4 (nearest) / 4.2e-4 (truncated) for
     mix and dphi at K = 1,200 and at K = 10,240 in the interpreter with TF32 emulated
     (tests/kernels/test_kernels_gpu_config.py); dA has two rounded operands, about sqrt(2) more. The
     deterministic worst case u * sum_k |a_k phi_k| ~ u * sqrt(2K/pi) * |mix| = 81 u (4e-2 rounded to nearest,
     8e-2 truncated) needs all rounding errors aligned, which random data does not produce; these tolerances
     are statistical, for random inputs.
  3. fp32 accumulation over K = 10,240 in BLOCK_K = 128 chunks, 80 chunk sums and 3 split-K partials: RMS about
     2^-24 * sqrt(128 + 80 + 3) = 9e-7 (worst case K * 2^-24 = 6e-4 of sum |a phi|). Negligible.
  4. The coefficients are fp32 functions of mix and sumsq (exact from bf16 x): with O(1) gates their relative
     error is at most that of mix, 2-4e-4 with TF32 (item 2). Tolerance 1e-3: over twice that, room
     for Sinkhorn's conditioning at other shapes and seeds, and 10x below the bf16 band, which would hide it.
  5. Every other tensor passes through bf16 stores (lin, out, dx, dy ...): about 1.5e-3 per store rounded to
     nearest, 3.1e-3 truncated (the interpreter); chained through F and the backward (about two stores) up to
     ~6e-3 in the interpreter, about half that compiled. TF32 adds at most its 4-6e-4 linearly (under 1e-4 in
     quadrature): the bf16 stores dominate and the band stays 1e-2 compiled at K = 10,240, and for every K;
     2e-2 under the interpreter (see tests/kernels/test_kernels_fused.py).
fp32 streams use input_precision="ieee" (no TF32), so only item 3 and fp32 stores apply: 1e-4.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout that is not installed


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="small shapes (CPU smoke test)")
    ap.add_argument("--tokens", type=int, default=None, help="T (default 4096; 96 with --small)")
    ap.add_argument("--hidden", type=int, nargs="*", default=None, help="C values (default 2560 4096 7168; 160 small)")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--launch", default="default", choices=["default", "gpu"],
                    help="kernel launch configuration: 'default' (the device's own: the GPU's when compiled, large "
                         "interpreter tiles on CPU) or 'gpu' (kernels.fused.use_config('gpu'): the GPU's tiles, "
                         "split-K/split-R partial sums and multi-program reductions, also under the interpreter)")
    ap.add_argument("--num-sms", type=int, default=None,
                    help="SM count for --launch gpu (required on CPU; a small one, e.g. 11, makes split > 1 happen "
                         "at --small shapes); default on CUDA: the device's")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/parity_<dev>.json)")
    args = ap.parse_args(argv)
    if args.launch == "gpu" and args.device == "cpu" and args.num_sms is None:
        ap.error("--launch gpu on --device cpu needs --num-sms (there is no SM count to read)")
    if args.num_sms is not None and args.num_sms < 1:
        ap.error(f"--num-sms {args.num_sms} must be >= 1")
    return args


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of kernels.fused

import contextlib  # noqa: E402

import torch  # noqa: E402

from kernels import reference  # noqa: E402
from kernels.config import MHCConfig  # noqa: E402
from kernels.parity import NAMES, parity_inputs, run_ops  # noqa: E402

F64 = torch.float64
COEFFS = ("h_pre", "h_post", "h_res")  # fp32 outputs computed from mix/sumsq only: no bf16 store on their path

# (stream dtype, tensor group, interpreted) -> tolerance; the derivation is in the module docstring.
TOLERANCES = {
    (torch.float32, "all", False): 1e-4, (torch.float32, "all", True): 1e-4,
    (torch.bfloat16, "coeffs", False): 1e-3, (torch.bfloat16, "coeffs", True): 1e-3,
    (torch.bfloat16, "other", False): 1e-2, (torch.bfloat16, "other", True): 2e-2,
}


def tolerance(dtype: torch.dtype, interpreted: bool, name: str | None = None) -> float:
    """Tolerance of tensor `name` (None: the general band, every tensor but the bf16 coefficients)."""
    if dtype == torch.float32:
        return TOLERANCES[(dtype, "all", interpreted)]
    group = "coeffs" if name in COEFFS else "other"
    return TOLERANCES[(dtype, group, interpreted)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().to(F64), b.detach().to(F64).to(a.device)
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def launch_context(launch: str, num_sms: int | None):
    import kernels.fused as fused

    return fused.use_config("gpu", num_sms=num_sms) if launch == "gpu" else contextlib.nullcontext()


def launch_summary(t: int, n: int, c: int, dtype: torch.dtype, device: str, launch: str, num_sms) -> dict:
    """The tiles and splits this case launches with (the same choice the fused ops make)."""
    import kernels.fused as fused

    with launch_context(launch, num_sms):
        lc = fused.launch_config(torch.device(device))
    m = MHCConfig(n=n).num_mix
    f, b = lc.project_fwd(t, n * c, m, dtype), lc.project_bwd(t, n * c, m, dtype)
    a, co = lc.apply(c, n), lc.coeffs(t)
    return dict(kind=lc.kind, num_sms=lc.num_sms, precision=f.precision, project_fwd_split=f.split,
                project_bwd_split=b.split, apply_block=[a.block_t, a.block_c], coeff_programs=co.grid)


def check(t: int, n: int, c: int, dtype: torch.dtype, device: str, seed: int, launch: str = "default",
          num_sms: int | None = None) -> list[dict]:
    import kernels.fused as fused

    cfg, leaves, g = parity_inputs(t, n, c, dtype, device, seed)
    ref = run_ops(reference, [v.to(F64) for v in leaves], g.to(F64), cfg, combined=False, dtype=F64)
    ref = [r.detach() for r in ref]
    tols = {k: tolerance(dtype, fused.INTERPRETED, k) for k in NAMES}
    lsum = launch_summary(t, n, c, dtype, device, launch, num_sms)
    rows = []
    for combined in (False, True):
        t0 = time.perf_counter()
        with launch_context(launch, num_sms):
            got = run_ops(fused, leaves, g, cfg, combined, dtype=dtype)
        if device == "cuda":
            torch.cuda.synchronize()
        errs = {k: rel(a, b) for k, a, b in zip(NAMES, got, ref)}
        # worst: the tensor closest to (or furthest past) its own tolerance; NaN first
        worst = max(errs, key=lambda k: float("inf") if errs[k] != errs[k] else errs[k] / tols[k])
        ok = all(errs[k] <= tols[k] for k in NAMES)  # NaN compares False: never passes
        rows.append(dict(T=t, n=n, C=c, dtype=str(dtype).split(".")[-1], combined=combined, tol=tols[worst],
                         tols=tols, ok=ok, worst=worst, worst_err=errs[worst], errors=errs, launch=lsum,
                         seconds=time.perf_counter() - t0))
        del got
    del ref, leaves, g
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    args = ARGS
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/kernel_parity.py: error: no CUDA device; use --device cpu --small", file=sys.stderr)
        return 2
    t = args.tokens or (96 if args.small else 4096)
    hidden = args.hidden or ([160] if args.small else [2560, 4096, 7168])
    cases = [(c, torch.bfloat16) for c in hidden] + [(hidden[0], torch.float32)]
    rows = []
    for i, (c, dtype) in enumerate(cases):
        rows += check(t, args.n, c, dtype, args.device, seed=1000 + i, launch=args.launch, num_sms=args.num_sms)
    print(f"{'T':>6}{'n':>3}{'C':>6} {'dtype':<9}{'combined':<9}{'worst':<8}{'rel err':>10}{'tol':>8}"
          f"{'coeffs':>10}{'tol':>8}  {'launch (kind, splits fwd/bwd, apply tile)':<44} ok")
    for r in rows:
        ce = max(r["errors"][k] for k in COEFFS)
        la = r["launch"]
        kind = f"gpu/{la['num_sms']} SMs" if la["kind"] == "gpu" else la["kind"]
        lstr = (f"{kind}, {la['project_fwd_split']}/{la['project_bwd_split']}, "
                f"{la['apply_block'][0]}x{la['apply_block'][1]}, {la['precision']}")
        print(f"{r['T']:>6}{r['n']:>3}{r['C']:>6} {r['dtype']:<9}{str(r['combined']):<9}{r['worst']:<8}"
              f"{r['worst_err']:>10.2e}{r['tol']:>8.0e}{ce:>10.2e}{r['tols']['h_res']:>8.0e}  {lstr:<44} "
              f"{'ok' if r['ok'] else 'FAIL'}")
    import kernels.fused as fused

    failed = [r for r in rows if not r["ok"]]
    result = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                  interpreter=fused.INTERPRETED, launch=args.launch, num_sms=args.num_sms,
                  torch=torch.__version__, small=args.small, cases=rows,
                  passed=len(rows) - len(failed), failed=len(failed))
    out = args.out or ROOT / "bench" / "results" / f"parity_{args.device}{'_small' if args.small else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed\nwrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
