"""CPU speed of the eager mHC ops (kernels.eager: Sinkhorn as one autograd node) against the unrolled reference.

    .venv/bin/python bench/eager_ops_cpu.py [--tokens 64 1024 4096] [--n 4 16] [--reps 30]
                                            [--out bench/results/eager_ops_cpu.json]

Shape letters: T tokens, n streams, C hidden. Two rows per (T, n), one thread, both variants timed in turn
(the order alternates every repetition, so both see the same drift of a shared host's speed), median of the
timed repetitions after 3 warm-up ones:
* `sinkhorn`: forward + backward of the 20-round projection of [T, n, n] logits, `kernels.sinkhorn.sinkhorn`
  (autograd through the unrolled loop) against `kernels.sinkhorn_node.sinkhorn_node`;
* `sublayer`: forward + backward of one mHC sub-layer (projection, coefficients, pre read, F = a C x C linear,
  post + res write) with `backend='reference'` against `backend='auto'` (the eager ops on CPU); C = 64.
Each row also checks the two agree: tensor-wise relative error of the output and of d(logits) / dx, float32.
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import MHCConfig, MHCSublayer
from kernels.sinkhorn import sinkhorn
from kernels.sinkhorn_node import sinkhorn_node

HIDDEN = 64


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def sinkhorn_case(t: int, n: int, gen: torch.Generator):
    logits = torch.randn(t, n, n, generator=gen)
    g = torch.randn(t, n, n, generator=gen)

    def make(fn):
        def run():
            z = logits.clone().requires_grad_(True)
            y = fn(z, 20, "exp", 0.0)
            y.backward(g)
            return y.detach(), z.grad
        return run
    return make(sinkhorn), make(sinkhorn_node)


def sublayer_case(t: int, n: int, gen: torch.Generator):
    x = torch.randn(t, n, HIDDEN, generator=gen)
    g = torch.randn(t, n, HIDDEN, generator=gen)
    w = torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5
    bias = torch.randn(2 * n + n * n, generator=gen)
    phi = torch.randn(n * HIDDEN, 2 * n + n * n, generator=gen) / (n * HIDDEN) ** 0.5

    def make(backend: str):
        f = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        with torch.no_grad():
            f.weight.copy_(w)
        m = MHCSublayer(MHCConfig(variant="mhc", n=n, backend=backend), f, hidden=HIDDEN)
        with torch.no_grad():  # O(1) gates: the Sinkhorn path carries gradient
            m.alpha.fill_(0.7)
            m.bias.copy_(bias)
            m.phi.copy_(phi)

        def run():
            xi = x.clone().requires_grad_(True)
            out = m(xi)
            out.backward(g)
            return out.detach(), xi.grad
        return run
    return make("reference"), make("auto")


def time_pair(ref, new, reps: int) -> tuple[float, float]:
    times: dict[str, list[float]] = {"ref": [], "new": []}
    for k in range(reps + 3):
        order = (("ref", ref), ("new", new)) if k % 2 == 0 else (("new", new), ("ref", ref))
        for name, fn in order:
            t0 = time.perf_counter()
            fn()
            if k >= 3:
                times[name].append(time.perf_counter() - t0)
    return statistics.median(times["ref"]), statistics.median(times["new"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 1024, 4096])
    ap.add_argument("--n", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "eager_ops_cpu.json")
    args = ap.parse_args(argv)
    for name, values in (("--tokens", args.tokens), ("--n", args.n)):
        if any(v < 1 for v in values):
            ap.error(f"{name} {values}: every value must be >= 1")
    if args.reps < 1:
        ap.error(f"--reps {args.reps}: must be >= 1")
    os.environ.pop("TRITON_INTERPRET", None)  # backend 'auto' must resolve to the eager ops
    torch.set_num_threads(1)
    rows = []
    print(f"{'op':<9} {'T':>5} {'n':>3} {'unrolled ms':>12} {'eager ms':>9} {'speed-up':>9} {'out err':>9} "
          f"{'grad err':>9}")
    for t in args.tokens:
        for n in args.n:
            for op, case in (("sinkhorn", sinkhorn_case), ("sublayer", sublayer_case)):
                ref, new = case(t, n, torch.Generator().manual_seed(t * 100 + n))
                (y_ref, g_ref), (y_new, g_new) = ref(), new()
                errs = rel(y_new, y_ref), rel(g_new, g_ref)
                t_ref, t_new = time_pair(ref, new, args.reps)
                row = {"op": op, "tokens": t, "n": n, "unrolled_ms": t_ref * 1e3, "eager_ms": t_new * 1e3,
                       "speedup": t_ref / t_new, "out_rel_err": errs[0], "grad_rel_err": errs[1]}
                rows.append(row)
                print(f"{op:<9} {t:>5} {n:>3} {row['unrolled_ms']:>12.3f} {row['eager_ms']:>9.3f} "
                      f"{row['speedup']:>8.2f}x {errs[0]:>9.1e} {errs[1]:>9.1e}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "what": "forward + backward, one thread, median of timed repetitions; unrolled = autograd through the "
                "reference loop (backend 'reference'), eager = kernels.eager (backend 'auto' on CPU)",
        "hidden": HIDDEN, "reps": args.reps, "rows": rows,
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "cpus": os.cpu_count()}},
        indent=1))
    print(f"wrote {args.out}")
    bad = [r for r in rows if r["out_rel_err"] > 1e-5 or r["grad_rel_err"] > 1e-4]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
