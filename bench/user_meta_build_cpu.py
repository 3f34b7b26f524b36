"""Benchmark: peak host memory per rank of a user model built whole on every rank against one built on the meta
device and materialised per stage (pipeline.user_materialise), on gloo ranks, one step each.

The model: `examples/plain_transformer.py` at hidden 1024, SwiGLU 4096, `--blocks` blocks (16: 268 M parameters,
1.07 GB in fp32), mHC n=4 around its sub-layers; 1F1B on `--pp` ranks (dp 1), M=8 micro-batches of 2 x 32 tokens.
Each variant runs in fresh rank processes (spawned: nothing inherited), which build the model, make the runtime,
run one step and report their peak resident set (ru_maxrss) and the parameters they hold.

    .venv/bin/python bench/user_meta_build_cpu.py [--pp 4] [--blocks 16] [--out bench/results/user_meta_build_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from configs import load_config  # noqa: E402
from pipeline.launch.local import launch  # noqa: E402

HIDDEN, FFN = 1024, 4096


def worker(rank: int, world: int, cfg_dict: dict, meta: bool, blocks: int) -> dict:
    import resource

    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    import plain_transformer

    from configs import parse_config
    from pipeline.launch.user_config import user_config
    from pipeline.runtime.train import RankRuntime, make_groups

    base = parse_config(cfg_dict)
    build = plain_transformer.build_meta if meta else plain_transformer.build
    from pipeline.model import seeded

    with seeded(base.train.seed, "user-model"):
        model = build("mhc:4", base.parallel.seq_len, HIDDEN, FFN, blocks)
    model_params = sum(p.numel() for p in model.named_parts().parameters())
    cfg = user_config(base, model)
    rt = RankRuntime(cfg, rank, torch.device("cpu"), groups=make_groups(cfg, rank, world, torch.device("cpu")),
                     record=False, model=model)
    built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak until the runtime is ready
    stats = rt.step(0)
    held = sum(p.numel() for p in rt.params.values())
    rt.close()
    return {"rank": rank, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "peak_rss_built_bytes": built,
            "params_held": held, "model_params": model_params, "loss": stats.loss, "step_s": stats.step_time_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "bench/results/user_meta_build_cpu.json"))
    args = ap.parse_args()
    data = load_config("tiny").model_dump()
    data["parallel"].update(schedule="1f1b", ranks=args.pp, data_parallel=1)
    data["train"].update(steps=1, timeout_s=600)
    out = {"machine": platform.processor() or platform.machine(), "pp": args.pp, "blocks": args.blocks,
           "hidden": HIDDEN, "ffn": FFN, "schedule": "1f1b", "variants": {}}
    for name, meta in (("full build per rank", False), ("meta, per stage", True)):
        got = launch(worker, args.pp, (data, meta, args.blocks), timeout_s=1800)
        bad = [r.error for r in got if r.exitcode != 0]
        if bad:
            raise SystemExit(f"{name}: {bad[0]}")
        rows = sorted((r.value for r in got), key=lambda v: v["rank"])
        out["variants"][name] = rows
    model_bytes = 4 * out["variants"]["meta, per stage"][0]["model_params"]
    out["model_bytes_fp32"] = model_bytes
    print(f"model: {model_bytes / 2**30:.2f} GiB of fp32 parameters, {args.blocks} blocks, 1F1B pp{args.pp}")
    print("peak RSS per rank (GiB): once the runtime is built / after one step (gradients, AdamW state)")
    print(f"{'rank':>4} {'params held':>12} {'full build per rank':>22} {'meta, per stage':>18}")
    full, meta = out["variants"]["full build per rank"], out["variants"]["meta, per stage"]
    for a, b in zip(full, meta):
        print(f"{a['rank']:>4} {b['params_held'] * 4 / 2**30:>8.2f} GiB {a['peak_rss_built_bytes'] / 2**30:>11.2f} / "
              f"{a['peak_rss_bytes'] / 2**30:.2f} {b['peak_rss_built_bytes'] / 2**30:>10.2f} / "
              f"{b['peak_rss_bytes'] / 2**30:.2f}")
    print(f"loss: full {full[0]['loss']:.6f}, meta {meta[0]['loss']:.6f} (different initial values: per-piece "
          "seeds against the builder's one stream)")
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
