"""High-priority stream placement changes no bit: mhc and mhc-sp stages with the hp stream vs without it.

    python bench/gpu_hp_check.py --out OUT/hp_bitwise.json                # H200: bf16, C=1024, T=2048
    python bench/gpu_hp_check.py --device cpu --small --out F.json        # CPU: the code path (no hp stream exists)

Shape letters: T tokens per micro-batch, n residual streams, C hidden, P ranks, M micro-batches.

On CUDA the runtime runs every MLP sub-layer's post+res on a priority -1 stream (`RankRuntime` creates
`torch.cuda.Stream(priority=-1)` and hands it to `pipeline.runtime.stage.StageEnv` as `hp`); the compute stream waits
for it only where the result is consumed (`StageEnv.sync_hp`). A missing wait or a tensor freed too early
(`record_stream`) is a race: it changes bits, or only sometimes. For each residual variant (default mhc:4 and
mhc-sp:4) and each rank of a DualPipeV pipeline of P = 2 (rank 0: embedding and head stages; rank 1: two middle
stages), two `RankRuntime`s of the same seed are built, one as the runtime builds it and one with `env.hp = None`
(post+res inline on the compute stream, the placement's only difference). Each runs the rank's full action list
(`Executor.run_step`: F, B, W and F&B pairs of M = 4 micro-batches; no process group: the P2P transport is a
`pipeline.distributed.loopback.LoopbackTransport` whose sends are captured) on fresh random inputs per check (a new
loopback seed for the received activations and gradients, a new synthetic batch; never zeros), in the order no-hp, hp,
no-hp. Compared with `torch.equal`: the loss, every tensor the rank sends (stage outputs and input-grads) and every
parameter gradient. hp vs no-hp must be bitwise equal; no-hp vs no-hp is the determinism baseline (if it differs,
the kernels are not deterministic and the hp comparison proves nothing; both are reported). On CUDA torch's
deterministic mode is on (warn_only, CUBLAS_WORKSPACE_CONFIG set; --no-deterministic turns it off), so attention's
backward and cuBLAS do not sum with atomics; it also fills fresh allocations with NaN, so an unwritten read shows.
Exit 1 when any hp comparison differs or the hp runtime recorded no span on the hp stream (CUDA).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout that is not installed

from bench.gpu_common import check_device, deterministic_mode  # noqa: E402

FULL = dict(vocab=4096, hidden=1024, heads=8, head_dim=128, mlp_hidden=2816, seq_len=2048, microbatch_size=1,
            dtype="bfloat16")
SMALL = dict(vocab=256, hidden=64, heads=4, head_dim=16, mlp_hidden=128, seq_len=32, microbatch_size=2,
             dtype="float32")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="the tiny shape (C=64, T=64, fp32): a smoke test")
    ap.add_argument("--variants", default="mhc:4,mhc-sp:4", help="residuals, comma-separated (default mhc:4,mhc-sp:4)")
    ap.add_argument("--ranks", default="0,1", help="DualPipeV ranks (of P=2) to check (default 0,1)")
    ap.add_argument("--checks", type=int, default=2, help="fresh random inputs per (variant, rank) (default 2)")
    ap.add_argument("--dtype", default=None, help="train.dtype (default bfloat16 on GPU, float32 small)")
    ap.add_argument("--blocks", type=int, default=8, help="model blocks (4 stages of P=2 DualPipeV; default 8)")
    ap.add_argument("--microbatches", type=int, default=4, help="M (default 4)")
    ap.add_argument("--no-deterministic", action="store_true",
                    help="CUDA: leave torch's deterministic mode off (default on: index_add, scatter and cuBLAS "
                         "without atomics, so two runs can be compared bit for bit)")
    ap.add_argument("--out", type=Path, default=None, help="JSON result (default bench/results/hp_bitwise_<dev>.json)")
    args = ap.parse_args(argv)
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    try:
        args.rank_list = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        ap.error(f"--ranks {args.ranks!r}: comma-separated integers")
    if not args.variant_list or any(r not in (0, 1) for r in args.rank_list):
        ap.error("--variants must name at least one residual and --ranks must be among 0,1")
    if args.checks < 1:
        ap.error("--checks must be >= 1")
    return args


def config(args, residual: str):
    from configs import parse_config
    from pipeline.launch.run_args import with_residual_flag

    s = SMALL if args.small else FULL
    data = {
        "model": {"name": "hp-check" + ("-small" if args.small else ""), "vocab_size": s["vocab"],
                  "num_blocks": args.blocks, "hidden": s["hidden"], "num_heads": s["heads"],
                  "head_dim": s["head_dim"], "mlp_hidden": s["mlp_hidden"]},
        "parallel": {"schedule": "dualpipev", "ranks": 2, "microbatches": args.microbatches,
                     "microbatch_size": s["microbatch_size"], "seq_len": s["seq_len"]},
        "recompute": {"mode": "off"},
        "train": {"steps": 1, "dtype": args.dtype or s["dtype"], "device": args.device, "timeout_s": 300.0,
                  "seed": 0},
    }
    return with_residual_flag(parse_config(data, "bench/gpu_hp_check.py"), "--residual", residual)


def capturing_loopback(rank, device, shape, dtype, seed):
    """A loopback transport that keeps a copy of every tensor the rank sends (by its trace name)."""
    from pipeline.distributed.loopback import LoopbackTransport

    class Capturing(LoopbackTransport):
        def __init__(self):
            super().__init__(rank, device, shape, dtype, seed=seed)
            self.sent: dict = {}

        def post(self, ops, labels=None):
            for is_send, name, _peer, tensor in ops:
                if is_send:
                    self.sent[name] = tensor.detach().clone()
            return super().post(ops, labels)

    return Capturing()


def run_once(rt, batch, shape, seed) -> dict:
    import torch

    loop = capturing_loopback(rt.groups.pp_rank, rt.device, shape, rt.dtype, seed)
    rt.use_transport(loop)
    rt.optimizer.zero_grad(set_to_none=True)
    cuda = rt.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(rt.device)
    t0 = time.perf_counter()
    loss = rt.executor.run_step(batch).detach().clone()
    if cuda:
        torch.cuda.synchronize(rt.device)
    ms = (time.perf_counter() - t0) * 1e3
    rt.recorder.flush_step()
    tensors = {"loss": loss}
    tensors.update({f"send:{k}": v for k, v in loop.sent.items()})
    tensors.update({f"grad:{k}": p.grad.detach().clone() for k, p in rt.params.items() if p.grad is not None})
    return {"tensors": tensors, "ms": ms}


def compare(a: dict, b: dict) -> dict:
    import torch

    names = sorted(set(a) | set(b))
    differ = [n for n in names if n not in a or n not in b or a[n].shape != b[n].shape or
              not torch.equal(a[n], b[n])]
    finite = all(bool(torch.isfinite(t.float()).all()) for t in a.values())
    return {"tensors": len(names), "equal": len(names) - len(differ), "differ": differ[:8], "finite": finite,
            "sends": sum(1 for n in names if n.startswith("send:")),
            "grads": sum(1 for n in names if n.startswith("grad:"))}


def check_rank(cfg, rank: int, device, checks: int) -> dict:
    from pipeline.data import Batch, make_batch
    from pipeline.runtime.train import RankRuntime, boundary_width

    hp_rt = RankRuntime(cfg, rank, device, record=True)
    none_rt = RankRuntime(cfg, rank, device, record=True)
    none_rt.env.hp = None  # the only difference: post+res inline on the compute stream
    none_rt.hp = None
    shape = (cfg.parallel.tokens_per_microbatch, cfg.model.residual.n, boundary_width(cfg))
    results = []
    for c in range(checks):
        seed = 1000 * (c + 1) + 17 * rank  # fresh received activations/gradients per check
        batch = make_batch(cfg, 100 + c)  # fresh tokens per check
        batch = Batch(batch.inputs, batch.labels)
        r0 = run_once(none_rt, batch, shape, seed)
        r1 = run_once(hp_rt, batch, shape, seed)
        r2 = run_once(none_rt, batch, shape, seed)
        results.append({"check": c, "seed": seed, "hp_vs_none": compare(r1["tensors"], r0["tensors"]),
                        "none_vs_none": compare(r2["tensors"], r0["tensors"]),
                        "ms": {"none": r0["ms"], "hp": r1["ms"], "none_again": r2["ms"]}})
        del r0, r1, r2
    hp_spans = [s for s in hp_rt.recorder.spans if s.stream == "hp"]
    return {"rank": rank, "stages": sorted(hp_rt.stages), "hp_stream": hp_rt.env.hp is not None,
            "hp_priority": getattr(hp_rt.env.hp, "priority", None), "hp_spans": len(hp_spans),
            "hp_median_us": statistics.median(s.duration for s in hp_spans) if hp_spans else None,
            "checks": results}


def main(argv=None) -> int:
    args = parse_args(argv)
    nondet = deterministic_mode(args.device, args.no_deterministic)
    import torch

    device = check_device(args.device, "bench/gpu_hp_check.py")
    if device is None:
        return 2
    cuda = device.type == "cuda"
    out: dict = {"device": torch.cuda.get_device_name(device) if cuda else
                 f"cpu ({platform.processor() or platform.machine()})", "torch": torch.__version__,
                 "small": args.small, "variants": {}, "problems": []}
    t0 = time.perf_counter()
    for variant in args.variant_list:
        cfg = config(args, variant)
        out["shape"] = {"P": 2, "M": cfg.parallel.microbatches, "T": cfg.parallel.tokens_per_microbatch,
                        "C": cfg.model.hidden, "blocks": cfg.model.num_blocks, "dtype": cfg.train.dtype}
        vt = time.perf_counter()
        try:
            ranks = [check_rank(cfg, r, device, args.checks) for r in args.rank_list]
        except Exception as err:  # noqa: BLE001 - one variant failing must not hide the other's result
            out["variants"][variant] = {"error": f"{type(err).__name__}: {err}"}
            out["problems"].append(f"{variant}: {type(err).__name__}: {err}")
            print(f"{variant}: FAILED: {type(err).__name__}: {err}")
            continue
        entry = {"ranks": ranks, "seconds": time.perf_counter() - vt}
        hp_eq = [c["hp_vs_none"] for r in ranks for c in r["checks"]]
        base_eq = [c["none_vs_none"] for r in ranks for c in r["checks"]]
        entry["hp_equal"] = f"{sum(c['equal'] for c in hp_eq)}/{sum(c['tensors'] for c in hp_eq)}"
        entry["baseline_equal"] = f"{sum(c['equal'] for c in base_eq)}/{sum(c['tensors'] for c in base_eq)}"
        entry["bitwise"] = all(c["equal"] == c["tensors"] for c in hp_eq)
        entry["deterministic"] = all(c["equal"] == c["tensors"] for c in base_eq)
        entry["finite"] = all(c["finite"] for c in hp_eq)
        entry["hp_spans"] = sum(r["hp_spans"] for r in ranks)
        entry["hp_stream"] = all(r["hp_stream"] for r in ranks)
        out["variants"][variant] = entry
        if not entry["bitwise"]:
            where = [f"rank {r['rank']} check {c['check']}: {c['hp_vs_none']['differ']}" for r in ranks
                     for c in r["checks"] if c["hp_vs_none"]["equal"] != c["hp_vs_none"]["tensors"]]
            what = ("hp placement changed bits" if entry["deterministic"] else
                    "inconclusive: the no-hp runtime is not deterministic itself, and hp vs no-hp differs")
            out["problems"].append(f"{variant}: {what} ({entry['hp_equal']} equal; no-hp vs no-hp "
                                   f"{entry['baseline_equal']}): {'; '.join(where)[:300]}")
        if not entry["finite"]:
            out["problems"].append(f"{variant}: non-finite loss, send or gradient")
        if cuda and (not entry["hp_stream"] or not entry["hp_spans"]):
            out["problems"].append(f"{variant}: the hp runtime has no hp stream or recorded no hp span")
        print(f"{variant}: hp vs no-hp bitwise {entry['hp_equal']} tensors (loss, sends, grads; ranks "
              f"{args.rank_list}, {args.checks} checks each), no-hp vs no-hp {entry['baseline_equal']}; hp spans "
              f"{entry['hp_spans']}{'' if cuda else ' (CPU: no hp stream exists, plumbing only)'}")
    out["seconds"] = time.perf_counter() - t0
    out["ok"] = not out["problems"]
    out["hp_stream_exists"] = cuda
    out["deterministic_mode"] = torch.are_deterministic_algorithms_enabled()
    out["nondeterministic_ops"] = nondet
    for p in out["problems"]:
        print(f"PROBLEM: {p}")
    path = args.out or ROOT / "bench" / "results" / f"hp_bitwise_{args.device}{'_small' if args.small else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"wrote {path}")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
