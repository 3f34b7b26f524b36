"""Full-size correctness of the fused mHC kernels: forward and every gradient against the float64 reference.

    python bench/kernel_parity.py                         # GPU: T=4096, n=4, C in {2560, 4096, 7168}, bf16 + fp32
    python bench/kernel_parity.py --device cpu --small    # smoke test under the Triton interpreter

Shape letters: T tokens, n streams, C hidden. tests/kernels checks the same math at small shapes (T <= 257,
C <= 320); this runs it at the shapes the benchmarks time, where the tiling, split-K projection and grid sizes
differ. Method (gpu.md §7): fresh random inputs for every case (never zeros), a random upstream gradient,
F(u) = u * scale + y0 so the gradient also flows through pre; the reference runs in float64 on the same
already-rounded inputs; relative Frobenius error ||fused - ref|| / ||ref||; NaN never passes. Tolerances: fp32
1e-4, bf16 1e-2 compiled on CUDA (gpu.md §7's bf16 band), 2e-2 under the interpreter (it truncates bf16
stores; see tests/kernels/test_kernels_fused.py). Both the separate ops and the combined pre side are checked.
Exit 1 when any case fails; writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, sys.path[0] is bench/, where bench/kernels.py would shadow the `kernels` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="small shapes (CPU smoke test)")
    ap.add_argument("--tokens", type=int, default=None, help="T (default 4096; 96 with --small)")
    ap.add_argument("--hidden", type=int, nargs="*", default=None, help="C values (default 2560 4096 7168; 160 small)")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/parity_<dev>.json)")
    return ap.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of kernels.fused

import torch  # noqa: E402

from kernels import reference  # noqa: E402
from kernels.config import MHCConfig  # noqa: E402

F64 = torch.float64
NAMES = ["out", "lin", "h_pre", "h_post", "h_res", "dx", "dphi", "dalpha", "dbias", "dscale", "dy0"]


def tolerance(dtype: torch.dtype, interpreted: bool) -> float:
    if dtype == torch.float32:
        return 1e-4
    return 2e-2 if interpreted else 1e-2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().to(F64), b.detach().to(F64).to(a.device)
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def inputs(t: int, n: int, c: int, dtype: torch.dtype, device: str, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    cfg = MHCConfig(n=n)

    def r(*s):
        return torch.randn(*s, generator=gen, device=device)

    x = r(t, n, c).to(dtype)
    phi = r(n * c, cfg.num_mix) / (n * c) ** 0.5
    alpha = torch.rand(3, generator=gen, device=device) + 0.5  # O(1) gates: the dynamic path carries weight
    bias = r(cfg.num_mix) * 0.5
    scale, y0 = r(c).to(dtype), r(t, c).to(dtype)
    g = r(t, n, c).to(dtype)  # random upstream gradient
    return cfg, [x, phi, alpha, bias, scale, y0], g


def run(ops, leaves, g, cfg, dtype, combined: bool):
    leaves = [v.detach().clone().to(dtype if i in (0, 4, 5) else v.dtype).requires_grad_()
              for i, v in enumerate(leaves)]
    x, phi, alpha, bias, scale, y0 = leaves
    t, n, c = x.shape
    if combined:
        lin, hp, hq, hr = ops.mhc_pre_side(x, phi, alpha, bias, cfg)
    else:
        mix, ss = ops.project(x, phi)
        hp, hq, hr = ops.coefficients(mix, ss, alpha, bias, cfg, n * c)
        lin = ops.pre(x, hp)
    out = ops.post_res(x, lin * scale + y0, hq, hr)
    out.backward(g.to(out.dtype))
    return [out, lin, hp, hq, hr] + [v.grad for v in leaves]


def check(t: int, n: int, c: int, dtype: torch.dtype, device: str, seed: int) -> list[dict]:
    import kernels.fused as fused

    cfg, leaves, g = inputs(t, n, c, dtype, device, seed)
    ref = run(reference, [v.to(F64) for v in leaves], g.to(F64), cfg, F64, combined=False)
    ref = [r.detach() for r in ref]
    tol = tolerance(dtype, fused.INTERPRETED)
    rows = []
    for combined in (False, True):
        t0 = time.perf_counter()
        got = run(fused, leaves, g, cfg, dtype, combined)
        if device == "cuda":
            torch.cuda.synchronize()
        errs = {k: rel(a, b) for k, a, b in zip(NAMES, got, ref)}
        worst = max(errs, key=lambda k: float("inf") if errs[k] != errs[k] else errs[k])
        ok = all(e <= tol for e in errs.values())  # NaN compares False: never passes
        rows.append(dict(T=t, n=n, C=c, dtype=str(dtype).split(".")[-1], combined=combined, tol=tol, ok=ok,
                         worst=worst, worst_err=errs[worst], errors=errs, seconds=time.perf_counter() - t0))
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
        rows += check(t, args.n, c, dtype, args.device, seed=1000 + i)
    print(f"{'T':>6}{'n':>3}{'C':>6} {'dtype':<9}{'combined':<9}{'worst':<8}{'rel err':>10}{'tol':>8}  ok")
    for r in rows:
        print(f"{r['T']:>6}{r['n']:>3}{r['C']:>6} {r['dtype']:<9}{str(r['combined']):<9}{r['worst']:<8}"
              f"{r['worst_err']:>10.2e}{r['tol']:>8.0e}  {'ok' if r['ok'] else 'FAIL'}")
    import kernels.fused as fused

    failed = [r for r in rows if not r["ok"]]
    result = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                  interpreter=fused.INTERPRETED, torch=torch.__version__, small=args.small, cases=rows,
                  passed=len(rows) - len(failed), failed=len(failed))
    out = args.out or ROOT / "bench" / "results" / f"parity_{args.device}{'_small' if args.small else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed\nwrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
