"""The threaded F&B pair on one device: one DualPipeV rank, a world-size-1 process group, 1-rank EP groups.

    python bench/gpu_pair_check.py --out OUT/fb_pair.json                  # H200: NCCL world size 1, fp32
    python bench/gpu_pair_check.py --device cpu --small --out F.json       # the same code path on gloo (CPU)

Shape letters: T tokens per micro-batch, n residual streams, C hidden, P ranks, M micro-batches, E experts.

What runs: `pipeline.runtime.train.RankRuntime` builds rank 0 of a DualPipeV pipeline (P = 2: stages 0 and 3, i.e. the
embedding and the head, 2 MoE-carrying blocks each; M = 8, so 11 of its actions are F&B pairs) of a MoE config,
with a process group of one rank (NCCL on CUDA, gloo with --device cpu; MASTER_ADDR 127.0.0.1, a free port) as
the world group and two 1-rank expert-parallel groups (`dist.new_group([0])` twice: "F" for the forward's
all-to-alls, "B" for the backward's) handed in through `pipeline.distributed.layout.ParallelGroups`. The pipeline P2P
transport is swapped for `pipeline.distributed.loopback.LoopbackTransport` (as bench/stage_bench.py does): every RECV
is a device copy of a pre-made random tensor, every SEND completes at once.

On a 1-rank EP group the runtime runs the experts locally (`ExpertComm.exchanging` is False for one rank), so
nothing would run on the pair's helper thread. This script sets `rt.expert.exchanging = True`: then the counts,
dispatch and combine all-to-alls (and their .dgrad backward exchanges) really go through the 1-rank groups, and
every F&B pair takes
`pipeline.runtime.overlap.PairRunner`'s threaded path (forward half here, backward half on the helper thread, turns
handed over at every all-to-all and block boundary; on CUDA both threads issue to the compute stream and NCCL runs
on its own streams).

Two runtimes of the same seed are built: overlap on (the threaded pairs) and off (`parallel.overlap: false`: F,
then B, every all-to-all waited right after its post). After warm-up steps their timed steps alternate
(O, S, S, O, ...); every step is a full `RankRuntime.step` (AdamW, bounded synchronize, the statistics and loss
all-gather on the world group), timed by its own CUDA-synchronised wall clock.

Checks (exit 1 when one fails):
* the overlapped trace has spans of both halves of pairs on the compute stream (`F/s../mb../L...`,
  `B/s../mb../L...`: only the threaded path names them so), `~comm` spans of the all-to-alls
  (`A2A_DISPATCH/...~comm`, `A2A_COMBINE/...~comm`, their `.counts` and `.dgrad`), and no half spans in the serial
  trace;
* every step's loss is finite and equals the serial runtime's, and every parameter gradient of every step equals
  the serial one's: tensor-wise relative norm ||g_o - g_s|| / ||g_s|| <= tol (1e-5 for float32; 1e-12 for float64,
  --dtype float64). On CUDA torch's deterministic mode is on (warn_only; CUBLAS_WORKSPACE_CONFIG set; off with
  --no-deterministic): without it the MoE's index_add (and index_select's backward) add with atomics, and a last-
  bit difference can flip a near-tie of the router's top-k in a later layer, i.e. move a token to another expert
  (a real difference of ~1e-3 in that expert's gradient, not a bug of the pair). How many tensors are bitwise equal
  is reported; ops that have no deterministic form are listed (`nondeterministic_ops`). Deterministic mode also
  fills fresh allocations with NaN (unwritten reads show) and costs some speed on both sides alike.
Reported: step time overlap vs serial (median of the timed steps) and their ratio, the F&B pair's median span,
span counts. On one GPU the all-to-alls are 1-rank (local copies), so the ratio measures the threaded path's
cost, not an overlap gain.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout that is not installed

from bench.gpu_common import check_device, deterministic_mode  # noqa: E402

# GPU: a MoE model whose rank-0 step takes tens of ms on an H200 (fp32); small: the tiny-moe shape.
FULL = dict(vocab=4096, hidden=1024, heads=8, head_dim=128, mlp_hidden=2816, experts=8, top_k=2, shared=1,
            expert_hidden=1024, seq_len=1024, microbatch_size=1)
SMALL = dict(vocab=256, hidden=64, heads=4, head_dim=16, mlp_hidden=128, experts=8, top_k=2, shared=1,
             expert_hidden=32, seq_len=32, microbatch_size=2)
TOL = {"float32": 1e-5, "float64": 1e-12}
HALF = re.compile(r"^(F|B)/s\d+/mb\d+/L\d+\.")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="the tiny-moe shape (C=64, T=64): a smoke test")
    ap.add_argument("--dtype", default="float32", choices=sorted(TOL), help="train.dtype (default float32)")
    ap.add_argument("--residual", default="mhc:4", help="residual VARIANT:N (default mhc:4)")
    ap.add_argument("--blocks", type=int, default=8, help="model blocks (P=2 DualPipeV: 4 stages; default 8)")
    ap.add_argument("--microbatches", type=int, default=8, help="M (default 8: 11 F&B pairs on rank 0)")
    ap.add_argument("--rank", type=int, default=0, help="DualPipeV rank (of P=2) whose action list runs")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each runtime first")
    ap.add_argument("--steps", type=int, default=4, help="timed steps of each runtime, interleaved")
    ap.add_argument("--timeout", type=float, default=120.0, help="train.timeout_s")
    ap.add_argument("--no-deterministic", action="store_true",
                    help="CUDA: leave torch's deterministic mode off (default on: index_add, scatter and cuBLAS "
                         "without atomics, so two runs can be compared bit for bit)")
    ap.add_argument("--trace-out", type=Path, default=None, help="write the overlapped runtime's trace here")
    ap.add_argument("--out", type=Path, default=None, help="JSON result (default bench/results/fb_pair_<dev>.json)")
    args = ap.parse_args(argv)
    if args.rank not in (0, 1):
        ap.error("--rank must be 0 or 1 (DualPipeV P=2)")
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    return args


def config(args):
    from configs import parse_config
    from pipeline.launch.run_args import with_residual_flag

    s = SMALL if args.small else FULL
    data = {
        "model": {"name": "fb-pair-check" + ("-small" if args.small else ""), "vocab_size": s["vocab"],
                  "num_blocks": args.blocks, "hidden": s["hidden"], "num_heads": s["heads"],
                  "head_dim": s["head_dim"], "mlp_hidden": s["mlp_hidden"],
                  "moe": {"num_experts": s["experts"], "top_k": s["top_k"], "num_shared": s["shared"],
                          "expert_hidden": s["expert_hidden"], "first_dense_blocks": 1}},
        "parallel": {"schedule": "dualpipev", "ranks": 2, "microbatches": args.microbatches,
                     "microbatch_size": s["microbatch_size"], "seq_len": s["seq_len"]},
        "recompute": {"mode": "off"},
        "train": {"steps": args.warmup + args.steps, "dtype": args.dtype, "device": args.device,
                  "timeout_s": args.timeout, "seed": 0, "gc_interval": 0},
    }
    cfg = parse_config(data, "bench/gpu_pair_check.py")
    return with_residual_flag(cfg, "--residual", args.residual)


# ---- process group of one rank ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_world1(backend: str, device, timeout_s: float) -> None:
    import datetime

    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    kw = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, rank=0, world_size=1, timeout=datetime.timedelta(seconds=timeout_s), **kw)


def force_exchanges(rt) -> list[int]:
    """Make the runtime's MoE layers exchange over their 1-rank EP groups (`ExpertComm.exchanging`), so F&B
    pairs take the threaded path; returns the stages that exchange."""
    rt.expert.exchanging = True
    return [s for s, st in rt.stages.items() if st.exchanges]


class Side:
    """One runtime (overlap on or off) on the shared groups, with its loopback transport."""

    def __init__(self, cfg, args, device, groups):
        from pipeline.distributed.loopback import LoopbackTransport
        from pipeline.runtime.train import RankRuntime, boundary_width

        t0 = time.perf_counter()
        self.rt = RankRuntime(cfg, args.rank, device, groups=groups, record=True)
        shape = (cfg.parallel.tokens_per_microbatch, cfg.model.residual.n, boundary_width(cfg))
        self.loop = LoopbackTransport(args.rank, device, shape, self.rt.dtype, seed=cfg.train.seed + 1)
        self.rt.use_transport(self.loop)
        self.exchanging = force_exchanges(self.rt)
        self.rt.recorder.align()
        self.losses: list[float] = []
        self.times: list[float] = []
        self.build_s = time.perf_counter() - t0

    def step(self, k: int, timed: bool) -> float:
        stats = self.rt.step(k)
        self.rt.recorder.flush_step(self.rt.timeout_s)
        self.losses.append(stats.loss)
        if timed:
            self.times.append(stats.step_time_s * 1e3)
        return stats.loss

    def grads(self) -> dict:
        return {k: p.grad.detach().clone() for k, p in self.rt.params.items() if p.grad is not None}


def rel_norm(a, b) -> float:
    import torch

    if a.shape != b.shape:
        return math.inf
    a64, b64 = a.double(), b.double()
    den = float(torch.linalg.vector_norm(b64))
    num = float(torch.linalg.vector_norm(a64 - b64))
    if not math.isfinite(num) or not math.isfinite(den):
        return math.inf
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def compare_grads(ga: dict, gb: dict) -> dict:
    import torch

    names = sorted(set(ga) | set(gb))
    missing = [n for n in names if n not in ga or n not in gb]
    rels = {n: rel_norm(ga[n], gb[n]) for n in names if n in ga and n in gb}
    worst = max(rels, key=rels.get) if rels else None
    return {"tensors": len(rels), "missing": missing,
            "bitwise": sum(1 for n in rels if torch.equal(ga[n], gb[n])),
            "max_rel": rels[worst] if worst else None, "worst": worst}


def trace_facts(spans) -> dict:
    compute = [s for s in spans if s.stream == "compute"]
    halves = {"F": 0, "B": 0}
    for s in compute:
        m = HALF.match(s.name or "")
        if m:
            halves[m.group(1)] += 1
    comm = [s for s in spans if s.stream == "comm" and (s.name or "").startswith(("A2A_DISPATCH", "A2A_COMBINE"))]
    parts = {}
    for s in comm:
        key = s.name.split("/", 1)[0] + ("." + s.name.rsplit(".", 1)[-1].replace("~comm", "")
                                          if re.search(r"L\d+\.\w+~comm$", s.name) else "")
        parts[key] = parts.get(key, 0) + 1
    fb = [s.duration for s in spans if s.kind == "FB"]
    return {"spans": len(spans), "half_spans": halves, "a2a_comm_spans": len(comm), "a2a_kinds": parts,
            "wait_spans": sum(1 for s in spans if s.kind == "WAIT"),
            "wfill_spans": sum(1 for s in spans if s.kind == "B.wfill"),
            "fb_spans": len(fb), "fb_median_ms": statistics.median(fb) / 1e3 if fb else None,
            "streams": sorted({s.stream for s in spans})}


def main(argv=None) -> int:
    args = parse_args(argv)
    nondet = deterministic_mode(args.device, args.no_deterministic)
    import torch
    import torch.distributed as dist

    device = check_device(args.device, "bench/gpu_pair_check.py")
    if device is None:
        return 2
    backend = "nccl" if device.type == "cuda" else "gloo"
    cfg = config(args)
    from pipeline.distributed.layout import Layout, ParallelGroups

    t_start = time.perf_counter()
    init_world1(backend, device, args.timeout)
    g_f, g_b = dist.new_group([0]), dist.new_group([0])
    layout = Layout.of(cfg)
    groups = ParallelGroups(layout, 0, args.rank, 0, 0, ep_groups={"F": g_f, "B": g_b},
                            world_group=dist.group.WORLD)
    serial_cfg = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"overlap": False})})
    sides = {"overlap": Side(cfg, args, device, groups), "serial": Side(serial_cfg, args, device, groups)}
    if sides["overlap"].rt.pair is None or sides["serial"].rt.pair is not None:
        raise RuntimeError("parallel.overlap did not select the pair runner as expected")
    setup_s = time.perf_counter() - t_start
    problems: list[str] = []
    step_cmp = []
    names = list(sides)
    total = args.warmup + args.steps
    t_run = time.perf_counter()
    for k in range(total):
        order = names if k % 2 == 0 else names[::-1]
        first, second = sides[order[0]], sides[order[1]]
        timed = k >= args.warmup
        first.step(k, timed)
        g_first = first.grads()
        second.step(k, timed)
        g_second = second.grads()
        go, gs = (g_first, g_second) if order[0] == "overlap" else (g_second, g_first)
        c = compare_grads(go, gs)
        lo, ls = sides["overlap"].losses[-1], sides["serial"].losses[-1]
        c.update(step=k, loss_overlap=lo, loss_serial=ls,
                 loss_rel=abs(lo - ls) / abs(ls) if ls else (0.0 if lo == ls else math.inf))
        step_cmp.append(c)
        del g_first, g_second, go, gs
    run_s = time.perf_counter() - t_run
    tol = TOL[args.dtype]
    facts = {name: trace_facts(side.rt.recorder.spans) for name, side in sides.items()}
    fo, fs = facts["overlap"], facts["serial"]
    if not fo["half_spans"]["F"] or not fo["half_spans"]["B"]:
        problems.append(f"overlapped trace lacks half spans on the compute stream: {fo['half_spans']}")
    if not fo["a2a_comm_spans"]:
        problems.append("overlapped trace has no all-to-all ~comm spans")
    if not fs["a2a_comm_spans"]:
        problems.append("serial trace has no all-to-all ~comm spans")
    if fs["half_spans"]["F"] or fs["half_spans"]["B"]:
        problems.append(f"serial trace has half spans {fs['half_spans']} (the threaded path ran with overlap off)")
    if not sides["overlap"].exchanging:
        problems.append("no local stage exchanges tokens: the threaded path cannot run")
    for c in step_cmp:
        if not all(math.isfinite(v) for v in (c["loss_overlap"], c["loss_serial"])):
            problems.append(f"step {c['step']}: loss not finite ({c['loss_overlap']}, {c['loss_serial']})")
        if c["loss_rel"] > tol:
            problems.append(f"step {c['step']}: loss overlap {c['loss_overlap']!r} vs serial {c['loss_serial']!r} "
                            f"(rel {c['loss_rel']:.1e} > {tol:.0e})")
        if c["missing"]:
            problems.append(f"step {c['step']}: gradients only on one side: {c['missing'][:4]}")
        if c["max_rel"] is None or c["max_rel"] > tol:
            problems.append(f"step {c['step']}: gradient {c['worst']} rel {c['max_rel']} > {tol:.0e}")
    has_loss = any(sp.has_head for sp in sides["overlap"].rt.plan.local())
    if has_loss and not all(c["loss_overlap"] for c in step_cmp):
        problems.append("a head rank printed a zero loss")
    to, ts = (statistics.median(sides[n].times) for n in ("overlap", "serial"))
    rt = sides["overlap"].rt
    fb_pairs = sum(1 for a in rt.executor.actions if a.kind.value == "FB")
    out = {
        "ok": not problems, "problems": problems,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
        f"cpu ({platform.processor() or platform.machine()})",
        "backend": backend, "torch": torch.__version__, "small": args.small, "dtype": args.dtype,
        "tolerance": tol, "residual": args.residual,
        "shape": {"P": 2, "rank": args.rank, "stages": sorted(rt.stages),
                  "exchanging_stages": sides["overlap"].exchanging,
                  "blocks": cfg.model.num_blocks, "T": cfg.parallel.tokens_per_microbatch, "C": cfg.model.hidden,
                  "experts": cfg.model.moe.num_experts, "top_k": cfg.model.moe.top_k, "M": cfg.parallel.microbatches,
                  "fb_pairs_per_step": fb_pairs},
        "forced_exchange_path": True,
        "deterministic_mode": torch.are_deterministic_algorithms_enabled(), "nondeterministic_ops": nondet,
        "step_ms": {"overlap": sides["overlap"].times, "serial": sides["serial"].times},
        "step_ms_median": {"overlap": to, "serial": ts}, "overlap_over_serial": to / ts,
        "fb_median_ms": {"overlap": fo["fb_median_ms"], "serial": fs["fb_median_ms"]},
        "losses": {"overlap": sides["overlap"].losses, "serial": sides["serial"].losses},
        "max_loss_rel": max(c["loss_rel"] for c in step_cmp),
        "max_grad_rel": max((c["max_rel"] for c in step_cmp if c["max_rel"] is not None), default=None),
        "bitwise_grads": f"{sum(c['bitwise'] for c in step_cmp)}/{sum(c['tensors'] for c in step_cmp)}",
        "steps": step_cmp, "trace": facts, "warmup": args.warmup, "timed_steps": args.steps,
        "setup_s": setup_s, "run_s": run_s,
        "loopback": {"sends": sides["overlap"].loop.sends, "recvs": sides["overlap"].loop.recvs},
    }
    if args.trace_out is not None:
        rt.recorder.save(args.trace_out, {"source": "measured", "device": str(device), "time_unit": "us",
                                          "model": cfg.model.name, "note": "bench/gpu_pair_check.py overlap side"})
        out["trace_file"] = str(args.trace_out)
    print(f"F&B pair check ({out['device']}, {backend} world size 1, 1-rank EP groups F/B, loopback P2P): DualPipeV "
          f"P=2 rank {args.rank}, stages {out['shape']['stages']}, {fb_pairs} F&B pairs/step, T={out['shape']['T']}, "
          f"C={cfg.model.hidden}, E={cfg.model.moe.num_experts} top-{cfg.model.moe.top_k}, {args.dtype}")
    print(f"  step overlap {to:.2f} ms vs serial {ts:.2f} ms (x{to / ts:.3f}; median of {args.steps}); "
          f"FB median {fo['fb_median_ms']:.2f} vs {fs['fb_median_ms']:.2f} ms")
    print(f"  trace: half spans F {fo['half_spans']['F']} B {fo['half_spans']['B']}, all-to-all comm spans "
          f"{fo['a2a_comm_spans']} {fo['a2a_kinds']}, WAIT {fo['wait_spans']}, wfill {fo['wfill_spans']}")
    print(f"  losses {['%.6f' % v for v in sides['overlap'].losses]}; max loss rel {out['max_loss_rel']:.1e}, "
          f"max grad rel {out['max_grad_rel']:.1e} (tol {tol:.0e}), bitwise grads {out['bitwise_grads']}")
    for p in problems:
        print(f"  PROBLEM: {p}")
    path = args.out or ROOT / "bench" / "results" / f"fb_pair_{args.device}{'_small' if args.small else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"wrote {path}")
    dist.destroy_process_group()
    return 0 if not problems else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the pair runner's helper thread and gloo's waiters are daemons: skip finalization
