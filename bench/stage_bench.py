"""Stage benchmark: one DualPipeV rank's exact action list at the paper-27B block shape, n = 1 vs mHC n = 4,
measured with the runtime's recorder and predicted by the cost model.

    python bench/stage_bench.py                         # GPU: C=2560, 32 x 128 heads, SwiGLU 12288, T=4096, bf16
    python bench/stage_bench.py --device cpu --small    # smoke test of the same code path at a tiny shape
    python bench/stage_bench.py --predict-only          # the cost model's prediction alone (runs anywhere)
    python bench/stage_bench.py --write-config F.yaml --config-ranks 2   # the same shape as a run config (torchrun)

Shape letters: T tokens per micro-batch, n residual streams, C hidden, P ranks, M micro-batches.

What runs: `pipeline.runtime.train.RankRuntime` builds rank r of a DualPipeV pipeline (default P = 4, rank 1: a middle
rank holding two stages of the V, no embedding or head) with M = 2P micro-batches; its transport is swapped
for `pipeline.distributed.loopback.LoopbackTransport`, so every RECV is a device copy of a pre-made tensor and every
SEND completes at once. The executor then runs the rank's lowered action list unchanged: both chunks, overlapped
F&B, the B/W split (I and W), mHC recompute (mode 'auto' for n = 4, off for n = 1) and, on CUDA, the MLP
post+res on the high-priority stream. The FFN is a dense SwiGLU of the 27B model's active FLOPs (8 x 1536 =
12288), so the baseline is not slowed by a naive local MoE. Both variants are built once (both stay resident,
so the CUDA peak memory includes the other variant's parameters); after their warm-up steps their timed steps
alternate (n=1, n=4, n=4, n=1, ...), so clock or thermal drift hits both alike, and the per-round ratio gives
the noise band. Every action is a recorder span (CUDA events on GPU). The optimizer step is not part of the
stage benchmark.

Measured: per-kind median action time (F, B, I, W, FB, RC, post+res on the hp stream; the F and B halves
inside an FB are not counted as F or B), the stage step (median of the step spans) and the mHC stage
overhead = step(n=4) / step(n=1) - 1. Predicted: the cost model prices the same actions (costmodel.answers.predict
.Pricer.compute_time, hardware 'h200' by default) for the same config, with the recompute block pinned to the
one the runtime uses, plus one device copy per received boundary tensor; the loopback removes P2P waits, so
the predicted step is the sum over the rank's actions. Targets (issue, GPU only): measured overhead <= 10 %,
|predicted - measured| <= 2 percentage points. On CPU the predictions are still for the H200: the CPU run
only exercises the code path.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout that is not installed

# The paper-27B block (mHC App. A.1; gpu.md §6 probe 2): dense-equivalent FFN of the same active FLOPs.
FULL = dict(hidden=2560, heads=32, head_dim=128, mlp_hidden=12288, tokens=4096, vocab=129280, blocks_per_stage=3,
            dtype="bfloat16")
SMALL = dict(hidden=64, heads=4, head_dim=16, mlp_hidden=256, tokens=64, vocab=256, blocks_per_stage=1,
             dtype="float32")
TARGET_OVERHEAD_PCT = 10.0
TARGET_DIFF_PP = 2.0
KINDS = ("F", "B", "I", "W", "FB", "RC", "F.post_res")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="tiny shape (C=64, T=64, fp32): a smoke test")
    ap.add_argument("--ranks", type=int, default=4, help="pipeline ranks P of the DualPipeV layout (default 4)")
    ap.add_argument("--rank", type=int, default=1, help="which rank's action list to run (default 1, a middle rank)")
    ap.add_argument("--microbatches", type=int, default=None, help="M (default 2P)")
    ap.add_argument("--blocks-per-stage", type=int, default=None,
                    help="Transformer blocks per stage (default 3; 1 small)")
    ap.add_argument("--tokens", type=int, default=None, help="T tokens per micro-batch (default 4096; 64 small)")
    ap.add_argument("--hidden", type=int, default=None, help="C (default 2560)")
    ap.add_argument("--heads", type=int, default=None, help="attention heads (default 32)")
    ap.add_argument("--head-dim", type=int, default=None, help="head dim (default 128)")
    ap.add_argument("--mlp-hidden", type=int, default=None, help="dense SwiGLU hidden (default 12288)")
    ap.add_argument("--n", type=int, default=4, help="mHC streams of the compared variant (default 4)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation, allocator)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per variant, interleaved (medians reported)")
    ap.add_argument("--hardware", default="h200", help="cost-model hardware of the prediction (default h200)")
    ap.add_argument("--predict-only", action="store_true", help="print the cost model's prediction, run nothing")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/stage_<device>.json)")
    ap.add_argument("--write-config", type=Path, default=None,
                    help="write this shape as a run config (YAML) for `python -m pipeline` and exit")
    ap.add_argument("--config-ranks", type=int, default=2, help="with --write-config: parallel.ranks (default 2)")
    ap.add_argument("--config-blocks-per-stage", type=int, default=1, help="with --write-config (default 1)")
    ap.add_argument("--config-steps", type=int, default=2, help="with --write-config: train.steps (default 2)")
    ap.add_argument("--config-timeout", type=float, default=300.0,
                    help="with --write-config: train.timeout_s (first steps compile kernels; default 300)")
    args = ap.parse_args(argv)
    base = SMALL if args.small else FULL
    for key in ("hidden", "heads", "head_dim", "mlp_hidden", "tokens", "blocks_per_stage"):
        if getattr(args, key) is None:
            setattr(args, key, base[key])
    args.vocab, args.dtype = base["vocab"], base["dtype"]
    if args.microbatches is None:
        args.microbatches = 2 * args.ranks
    for key in ("ranks", "microbatches", "blocks_per_stage", "tokens", "hidden", "heads", "head_dim", "mlp_hidden",
                "n", "steps", "config_ranks", "config_blocks_per_stage", "config_steps"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.warmup < 0:
        ap.error("--warmup must be >= 0")
    if not 0 <= args.rank < args.ranks:
        ap.error(f"--rank {args.rank} is outside the {args.ranks} ranks (--ranks)")
    if args.n < 2:
        ap.error("--n is the mHC variant compared with the n=1 baseline; use n >= 2")
    return args


# ---- configs --------------------------------------------------------------------------------------------------
def config_dict(args, *, n: int, ranks: int, blocks_per_stage: int, microbatches: int, steps: int = 1,
                timeout_s: float = 300.0) -> dict:
    """A DualPipeV run config at the benchmark shape; n = 1 is the plain residual without recompute."""
    return {
        "model": {"name": "paper-27b-block" + ("-small" if args.small else ""), "vocab_size": args.vocab,
                  "num_blocks": 2 * ranks * blocks_per_stage, "hidden": args.hidden, "num_heads": args.heads,
                  "head_dim": args.head_dim, "mlp_hidden": args.mlp_hidden,
                  "residual": {"variant": "mhc", "n": n} if n > 1 else {"variant": "residual", "n": 1}},
        "parallel": {"schedule": "dualpipev", "ranks": ranks, "microbatches": microbatches, "microbatch_size": 1,
                     "seq_len": args.tokens},
        "recompute": {"mode": "auto" if n > 1 else "off"},
        "train": {"steps": steps, "dtype": args.dtype, "device": args.device, "timeout_s": timeout_s, "seed": 0},
    }


def bench_config(args, n: int):
    from configs import parse_config

    return parse_config(config_dict(args, n=n, ranks=args.ranks, blocks_per_stage=args.blocks_per_stage,
                                    microbatches=args.microbatches), "bench/stage_bench.py")


def write_run_config(args) -> Path:
    """The benchmark shape as a YAML run config (written as JSON, which YAML reads) for `python -m pipeline`."""
    from configs import parse_config

    data = config_dict(args, n=args.n, ranks=args.config_ranks, blocks_per_stage=args.config_blocks_per_stage,
                       microbatches=2 * args.config_ranks, steps=args.config_steps, timeout_s=args.config_timeout)
    parse_config(data, str(args.write_config))  # fail here, not in torchrun
    args.write_config.parent.mkdir(parents=True, exist_ok=True)
    args.write_config.write_text(json.dumps(data, indent=1) + "\n")
    return args.write_config


# ---- prediction -----------------------------------------------------------------------------------------------
def predict_rank(cfg, rank: int, hardware: str, rc_block: int | None) -> dict:
    """Cost-model prices of rank `rank`'s compute actions for `cfg`, summed (no P2P waits with the loopback),
    plus one device copy (read + write) per received boundary tensor."""
    from costmodel.physics.hardware import get_hardware
    from costmodel.answers.predict import residual_spec_of
    from costmodel.pricing.pricer import Pricer
    from costmodel.pricing.stage_split import resolve_layout
    from costmodel.pricing.options import Options
    from schedules import build, lower_comms
    from schedules.ir import COMM_KINDS, Kind

    if rc_block is not None:  # price the recompute block the runtime actually uses
        cfg = cfg.model_copy(update={"recompute": cfg.recompute.model_copy(
            update={"mode": "block", "block_size": rc_block})})
    hw = get_hardware(hardware)
    par = cfg.parallel
    schedule = build(par.schedule, par.ranks, par.microbatches)
    layout = resolve_layout(cfg, schedule, False)
    spec = residual_spec_of(cfg)
    pricer = Pricer(cfg, hw, spec, layout, Options(), recompute=rc_block is not None)
    per_kind: dict[str, list[float]] = {}
    compute_us = 0.0
    for a in schedule.actions[rank]:
        if a.kind in COMM_KINDS:
            continue
        us = pricer.compute_time(a)
        compute_us += us
        per_kind.setdefault(a.kind.value, []).append(us)
    recvs = sum(1 for a in lower_comms(schedule).actions[rank] if a.kind in (Kind.RECV_F, Kind.RECV_B))
    copy_us = hw.memory_us(2 * pricer.message_bytes) + hw.launch_us
    rc = [r.group_time.get("recompute", 0.0) for k, r in pricer.results.items() if k[0] in ("B", "I")]
    sub = 2 * len(layout[schedule.stages_of(rank)[0]][0])
    rc_blocks = math.ceil(sub / rc_block) if rc_block else 0
    kinds = {k: statistics.median(v) for k, v in per_kind.items()}
    if rc_blocks and rc:
        kinds["RC"] = statistics.median(rc) / rc_blocks
    return {"hardware": hw.name, "residual": spec.label(), "recompute_block": rc_block,
            "kind_us": kinds, "compute_us": compute_us, "recv_copies": recvs, "recv_copy_us": copy_us,
            "step_us": compute_us + recvs * copy_us, "boundary_bytes": pricer.message_bytes}


def runtime_block(cfg, rank: int) -> int | None:
    """The recompute block the runtime uses on this rank (pipeline.runtime.train.RankRuntime.rc_block): per local stage
    `configs.recompute_block_size` over that stage's sub-layers, the largest of them."""
    from configs import recompute_block_size
    from pipeline.partition import plan_rank

    sizes = [recompute_block_size(cfg.recompute, 2 * len(sp.blocks), cfg.model.residual.n)
             for sp in plan_rank(cfg, rank).local()]
    return max((b for b in sizes if b is not None), default=None)


# ---- measurement ----------------------------------------------------------------------------------------------
def fb_halves(schedule, rank: int) -> set[tuple[str, int, int]]:
    """(kind, stage, mb) of the F and B halves that run inside an overlapped FB of this rank."""
    from schedules.ir import Kind

    out = set()
    for a in schedule.actions[rank]:
        if a.kind is Kind.FB:
            out.add(("F", a.stage, a.mb))
            out.add(("B", a.b_stage, a.b_mb))
    return out


class RankBench:
    """One variant's rank: the runtime with its loopback transport, stepped and timed one step at a time."""

    def __init__(self, cfg, args, device):
        from pipeline.data import make_batch
        from pipeline.distributed.loopback import LoopbackTransport
        from pipeline.runtime.train import RankRuntime

        t0 = time.perf_counter()
        self.device, self.cuda = device, device.type == "cuda"
        self.rt = RankRuntime(cfg, args.rank, device, record=True)
        shape = (cfg.parallel.tokens_per_microbatch, cfg.model.residual.n, cfg.model.hidden)
        self.loop = LoopbackTransport(args.rank, device, shape, self.rt.dtype, seed=cfg.train.seed)
        self.rt.use_transport(self.loop)
        self.inner = fb_halves(self.rt.plan.schedule, args.rank)
        self.batch = make_batch(cfg, 0)
        self.rt.recorder.align()
        self.steps, self.walls, self.act_peaks, self.mem_peaks = [], [], [], []
        self.kinds: dict[str, list[float]] = {k: [] for k in KINDS}
        self.timed = 0
        self.build_s = time.perf_counter() - t0

    def step(self, k: int, timed: bool) -> None:
        import torch

        rt, rec = self.rt, self.rt.recorder
        rt.optimizer.zero_grad(set_to_none=True)
        rt.saved.reset_peak()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        mark = len(rec.spans)
        t0 = time.perf_counter()
        with rec.range("step", None, None, name=f"step/{k}"):
            rt.executor.run_step(self.batch)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - t0
        rec.flush_step()
        if not timed:
            return
        self.timed += 1
        self.walls.append(wall * 1e3)
        self.act_peaks.append(rt.saved.peak)
        if self.cuda:
            self.mem_peaks.append(torch.cuda.max_memory_allocated(self.device))
        for s in rec.spans[mark:]:
            if s.kind == "step":
                self.steps.append(s.duration / 1e3)
            elif s.kind in self.kinds and (s.kind, s.stage, s.mb) not in self.inner:
                self.kinds[s.kind].append(s.duration / 1e3)

    def result(self) -> dict:
        rt = self.rt
        return {
            "recompute_block": rt.rc_block,
            "step_ms": self.steps, "step_ms_median": statistics.median(self.steps),
            "wall_ms": self.walls, "wall_ms_median": statistics.median(self.walls),
            "kind_ms": {k: statistics.median(v) for k, v in self.kinds.items() if v},
            "kind_count_per_step": {k: len(v) // self.timed for k, v in self.kinds.items() if v},
            "peak_saved_act_GiB": max(self.act_peaks) / 2**30,
            "peak_mem_GiB": max(self.mem_peaks) / 2**30 if self.mem_peaks else None,
            "hp_stream": rt.env.hp is not None, "hp_spans": sum(1 for s in rt.recorder.spans if s.stream == "hp"),
            "loopback": {"sends": self.loop.sends, "recvs": self.loop.recvs},
            "stages": [sp.stage for sp in rt.plan.local()],
            "blocks": {sp.stage: [sp.blocks.start, sp.blocks.stop] for sp in rt.plan.local()},
            "build_s": self.build_s,
        }


def measure(cfgs: dict, args, device) -> tuple[dict, list[float]]:
    """Build every variant's rank, warm each up, then time their steps interleaved (n=1, n=4, n=4, n=1, ...), so
    clock or thermal drift hits both alike; returns per-variant results and the paired per-round overheads (%)."""
    import torch

    benches = {name: RankBench(cfg, args, device) for name, cfg in cfgs.items()}
    for k in range(args.warmup):
        for b in benches.values():
            b.step(k, timed=False)
    names = list(benches)
    for k in range(args.steps):
        for name in (names if k % 2 == 0 else names[::-1]):
            benches[name].step(args.warmup + k, timed=True)
    base, other = (benches[n] for n in names)
    paired = [100 * (b / a - 1) for a, b in zip(base.steps, other.steps)]
    out = {name: b.result() for name, b in benches.items()}
    del benches, base, other
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out, paired


# ---- report ---------------------------------------------------------------------------------------------------
def fmt(v, spec=".3f", none="-"):
    return none if v is None else format(v, spec)


def table(res: dict) -> str:
    lines = []
    s = res["shape"]
    lines.append(f"stage benchmark: DualPipeV P={s['ranks']} rank {s['rank']} (stages {s['stages']}), "
                 f"{s['blocks_per_stage']} blocks/stage, T={s['T']}, C={s['C']}, {s['heads']}x{s['head_dim']} heads, "
                 f"SwiGLU {s['mlp_hidden']}, {s['dtype']}, M={s['M']}, device {res['device']}")
    where = ("" if res["device_is_gpu"] else " (nothing measured)" if res["device"] == "predict-only"
             else " (not this machine: a CPU run only checks the code path)")
    lines.append(f"predictions: cost model, hardware {res['hardware']}{where}")
    v1, v4 = res["variants"]["n1"], res["variants"][f"n{res['n']}"]
    n = res["n"]
    lines.append(f"{'kind':<12}{'n=1 meas':>10}{'n=1 pred':>10}{f'n={n} meas':>10}{f'n={n} pred':>10}"
                 f"{'d meas':>9}{'d pred':>9}   (ms per action, median; d = n={n} - n=1)")
    for k in KINDS + ("step",):
        row = []
        for v in (v1, v4):
            m, p = v.get("measured"), v["predicted"]
            if k == "step":
                mv, pv = (None if m is None else m["step_ms_median"]), p["step_us"] / 1e3
            else:
                mv, pv = (None if m is None else m["kind_ms"].get(k)), p["kind_us"].get(k)
                pv = None if pv is None else pv / 1e3
            row.append((mv, pv))
        if all(x is None for pair in row for x in pair):
            continue
        dm = row[1][0] - (row[0][0] or 0.0) if row[1][0] is not None else None
        dp = row[1][1] - (row[0][1] or 0.0) if row[1][1] is not None else None
        label = "post_res~hp" if k == "F.post_res" else k
        lines.append(f"{label:<12}{fmt(row[0][0]):>10}{fmt(row[0][1]):>10}{fmt(row[1][0]):>10}{fmt(row[1][1]):>10}"
                     f"{fmt(dm, '+.3f'):>9}{fmt(dp, '+.3f'):>9}")
    o = res["overhead"]
    band = (f" (paired rounds {o['paired_min_pct']:+.1f}..{o['paired_max_pct']:+.1f}%)"
            if o.get("paired_min_pct") is not None else "")
    lines.append(f"mHC stage overhead: measured {fmt(o['measured_pct'], '+.1f')}%{band}, predicted "
                 f"{fmt(o['predicted_pct'], '+.1f')}%, diff {fmt(o['diff_pp'], '+.1f')} pp")
    t = res["targets"]
    lines.append(f"targets (GPU): measured <= {TARGET_OVERHEAD_PCT:g}%: {t['overhead_ok']}; "
                 f"|pred - meas| <= {TARGET_DIFF_PP:g} pp: {t['diff_ok']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.write_config is not None:
        print(f"wrote {write_run_config(args)}")
        return 0
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not args.predict_only and not torch.cuda.is_available():
        print("bench/stage_bench.py: error: no CUDA device; use --device cpu --small for a smoke test, or "
              "--predict-only", file=sys.stderr)
        return 2
    variants = {"n1": bench_config(args, 1), f"n{args.n}": bench_config(args, args.n)}
    out: dict = {"n": args.n, "hardware": args.hardware,
                 "device_is_gpu": device.type == "cuda" and not args.predict_only,
                 "device": ("predict-only" if args.predict_only else
                            torch.cuda.get_device_name(device) if device.type == "cuda" else
                            f"cpu ({platform.processor() or platform.machine()})"),
                 "torch": torch.__version__, "small": args.small, "warmup": args.warmup, "steps": args.steps,
                 "variants": {}, "notes": []}
    from pipeline.partition import plan_rank

    plan = plan_rank(variants["n1"], args.rank)
    out["shape"] = {"ranks": args.ranks, "rank": args.rank, "stages": [sp.stage for sp in plan.local()],
                    "blocks_per_stage": args.blocks_per_stage, "T": args.tokens, "C": args.hidden, "heads": args.heads,
                    "head_dim": args.head_dim, "mlp_hidden": args.mlp_hidden, "dtype": args.dtype,
                    "M": args.microbatches, "num_blocks": variants["n1"].model.num_blocks}
    if any(sp.has_embed or sp.has_head for sp in plan.local()):
        out["notes"].append(f"rank {args.rank} holds the embedding or the head: not a middle rank")
    for name, cfg in variants.items():
        rc = runtime_block(cfg, args.rank)
        out["variants"][name] = {"predicted": predict_rank(cfg, args.rank, args.hardware, rc), "rc_assumed": rc}
    paired = None
    if not args.predict_only:
        t0 = time.perf_counter()
        measured, paired = measure(variants, args, device)
        out["measure_s"] = time.perf_counter() - t0
        for name, m in measured.items():
            entry = out["variants"][name]
            entry["measured"] = m
            used = m["recompute_block"]
            if used != entry["rc_assumed"]:
                out["notes"].append(f"{name}: the runtime recomputed blocks of {used} sub-layers, the prediction "
                                    f"assumed {entry['rc_assumed']}")
    v1, v4 = out["variants"]["n1"], out["variants"][f"n{args.n}"]
    pred = 100 * (v4["predicted"]["step_us"] / v1["predicted"]["step_us"] - 1)
    meas = diff = None
    if not args.predict_only:
        meas = 100 * (v4["measured"]["step_ms_median"] / v1["measured"]["step_ms_median"] - 1)
        diff = pred - meas
    out["overhead"] = {"measured_pct": meas, "predicted_pct": pred, "diff_pp": diff,
                       "paired_pct": paired,  # per timed round: step(n) / step(n=1) - 1, the noise band
                       "paired_min_pct": min(paired) if paired else None,
                       "paired_max_pct": max(paired) if paired else None}
    gpu = out["device_is_gpu"]
    out["targets"] = {"overhead_pct_max": TARGET_OVERHEAD_PCT, "diff_pp_max": TARGET_DIFF_PP,
                      "overhead_ok": (meas <= TARGET_OVERHEAD_PCT) if gpu else "n/a (not a GPU run)",
                      "diff_ok": (abs(diff) <= TARGET_DIFF_PP) if gpu else "n/a (not a GPU run)"}
    out["notes"].append("stage boundaries are local hand-offs (pipeline.distributed.loopback): no P2P time in the "
                        "step; the optimizer step is excluded")
    print(table(out))
    for note in out["notes"]:
        print(f"note: {note}")
    dev = "predict" if args.predict_only else args.device
    path = args.out or ROOT / "bench" / "results" / f"stage_{dev}{'_small' if args.small else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
