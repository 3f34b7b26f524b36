"""`mhcpipe check-split`: does your model, split into pipeline stages, compute what the unsplit model computes?

    mhcpipe check-split MODEL [--schedule all|KIND[,KIND..]] [--layouts pp4,pp2xdp2] [--config tiny]
                        [--microbatches M] [--residual VARIANT:N] [--rtol 1e-9]
                        [--comm-rules nccl|nccl-pair|backend] [--emulate-cuda] [--json OUT]

example: mhcpipe check-split examples/hc_model.py:build

MODEL is FILE.py:FUNCTION or MODULE:FUNCTION naming a builder that returns a pipeline.user_model.UserModel. Every
schedule x layout runs one step on CPU ranks (gloo, float64) through the real runtime and is compared with the
unsplit model on the same batch (pipeline.launch.check_split): per case `ok` with the worst relative error, or the
first difference named by stage, rank, blocks and micro-batch (boundary states and gradients, losses, then
parameters). --config gives the batch (micro-batches, sequence length, sequences per micro-batch) and the seed.
Exit 0 when every case is ok, 1 when one differs, 2 for bad input (one line).
"""
from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

HELP = "your model split into pipeline stages vs unsplit: loss, boundary tensors and every gradient (float64)"
EXAMPLE = "mhcpipe check-split examples/hc_model.py:build"


def register(subparsers) -> None:
    p = subparsers.add_parser("check-split", help=HELP, description=f"{HELP}\n\nexample: {EXAMPLE}",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="FILE.py:FUNCTION or MODULE:FUNCTION returning a UserModel")
    from schedules.registry import names

    p.add_argument("--schedule", default="all", help=f"'all' (default) or a comma list of {', '.join(names())}")
    p.add_argument("--layouts", default="pp4,pp2xdp2", help="comma list of ppP[xdpD] (default pp4,pp2xdp2: 4 ranks)")
    p.add_argument("--config", default="tiny", help="preset or YAML giving the batch and seed (default tiny)")
    p.add_argument("--microbatches", type=int, help="parallel.microbatches (default: the config's)")
    p.add_argument("--residual", help="for builders that take it: the residual their sub-layers are wrapped in")
    p.add_argument("--rtol", type=float,
                   help="relative tolerance (default 1e-9; pipeline/launch/check_split.py says why)")
    p.add_argument("--comm-rules", choices=("nccl", "nccl-pair", "backend"), default="nccl",
                   help="train.comm_rules of every case: P2P under NCCL's rules (default: an order NCCL would hang on "
                        "or mismatch fails with every rank's queue heads) or plain gloo's ('backend': a mismatched "
                        "order then shows as wrong numbers)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for all cases of one world size")
    p.add_argument("--p2p-timeout", type=float, help="seconds any wait inside a step may take (train.timeout_s; "
                                                     "default the config's)")
    p.add_argument("--json", dest="json_out", type=Path, help="write every case's result here")
    p.add_argument("--dtype", choices=("float64", "bfloat16"), default="float64",
                   help="every case's and the unsplit model's train.dtype (default float64; bfloat16: autocast, "
                        "fp32 parameters, compared norm-wise with rtol 1e-3 unless --rtol)")
    p.add_argument("--recompute", choices=("off", "auto"), default="off",
                   help="'auto': each stage's blocks recomputed as one unit in its backward (the mHC recipe)")
    p.add_argument("--emulate-cuda", action="store_true",
                   help="run each case on the runtime's CUDA path under the emulated CUDA device and replay its "
                        "programs under CUDA's and NCCL's rules (docs/cuda_program.md)")
    p.set_defaults(func=run_check_split)


def parse_layouts(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        m = re.fullmatch(r"pp(\d+)(?:xdp(\d+))?", item.strip())
        if not m or int(m.group(1)) < 1 or (m.group(2) is not None and int(m.group(2)) < 1):
            raise ValueError(f"--layouts {text!r}: each item is ppP or ppPxdpD with P, D >= 1, e.g. pp4,pp2xdp2")
        out.append((int(m.group(1)), int(m.group(2) or 1)))
    return out


def parse_schedules(text: str) -> list[str]:
    from schedules.registry import names

    SCHEDULES = names()  # every registered kind (schedules.registry)

    if text == "all":
        return list(SCHEDULES)
    kinds = [k.strip() for k in text.split(",")]
    bad = [k for k in kinds if k not in SCHEDULES]
    if bad:
        raise ValueError(f"--schedule {bad[0]!r}: use 'all' or a comma list of {', '.join(SCHEDULES)}")
    return kinds


def run_check_split(args) -> int:
    from configs import load_config
    from pipeline.launch.check_split import BF16_RTOL, DEFAULT_RTOL, run_cases

    layouts, schedules = parse_layouts(args.layouts), parse_schedules(args.schedule)
    rtol = (BF16_RTOL if args.dtype == "bfloat16" else DEFAULT_RTOL) if args.rtol is None else args.rtol
    if rtol <= 0:
        raise ValueError(f"--rtol {rtol:g}: must be > 0")
    for flag, value in (("--timeout", args.timeout), ("--p2p-timeout", args.p2p_timeout)):
        if value is not None and value <= 0:
            raise ValueError(f"{flag} {value:g}: must be > 0 seconds")
    if args.microbatches is not None and args.microbatches < 1:
        raise ValueError(f"--microbatches {args.microbatches}: must be >= 1")
    base = load_config(args.config, {"parallel": {"microbatches": args.microbatches}} if args.microbatches else None)
    cases = [(s, pp, dp) for pp, dp in layouts for s in schedules]
    what = args.dtype + (", recompute auto" if args.recompute != "off" else "")
    print(f"check-split {args.model}: {len(cases)} cases against the unsplit model ({what}, rtol {rtol:g})",
          flush=True)
    started = time.perf_counter()
    results = run_cases(args.model, base, cases, residual=args.residual, rtol=rtol, rules=args.comm_rules,
                        timeout_s=args.timeout, p2p_timeout_s=args.p2p_timeout,
                        log=lambda line: print(line, flush=True), emulate_cuda=args.emulate_cuda,
                        dtype=args.dtype, recompute=args.recompute)
    for r in results:
        if not r.ok and not r.skipped and r.message.startswith("rank "):
            print(r.line(), flush=True)  # a failed launch: not logged per case
    ran = [r for r in results if not r.skipped]
    bad = [r for r in ran if not r.ok]
    worst = max((r.worst for r in ran if r.ok), default=float("nan"))
    skipped = len(results) - len(ran)
    print(f"{'ok' if not bad else 'FAIL'}: {len(ran) - len(bad)}/{len(ran)} cases agree"
          f"{f' ({skipped} skipped: the model cannot fill them)' if skipped else ''}; worst relative error "
          f"{worst:.1e} ({time.perf_counter() - started:.1f} s)")
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({"model": args.model, "rtol": rtol, "cases": [
            {"schedule": r.schedule, "pp": r.pp, "dp": r.dp, "ok": r.ok, "skipped": r.skipped, "message": r.message,
             "worst_relative_error": r.worst, "loss": r.loss} for r in results]}, indent=1))
    return 0 if not bad else 1
