"""`mhcpipe tune`: search the parallel layout (PP, DP, EP, micro-batches, recompute, schedule, uneven stages, hp
placement) under a per-GPU memory budget and a fixed global batch; print the Pareto front of step time against
memory per GPU and write the fastest layout as a config that `mhcpipe run --config` and `mhcpipe predict
--config` accept (costmodel/answers/tune.py says what is searched, priced and pruned).

Examples:
  mhcpipe tune --preset paper-27b --hardware h800 --gpus 48 --memory-gib 80 --global-batch 1280 -o best.yaml
  mhcpipe tune --preset paper-9b --hardware h100 --gpus 16 --schedules 1f1b,dualpipev --recompute off,auto
  mhcpipe tune --preset paper-27b --gpus 48 --global-batch 1280 --distributed-optimizer off --json tune.json

Layouts within 2% of the best step (tune.TIE_PCT, the model's error band) are listed as ties, most memory
headroom first: the model cannot tell them apart.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path

from costmodel.physics.hardware import hardware_names
from schedules.registry import kind_of, names


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="search PP/DP/EP/M/recompute/schedule for the fastest layout that fits",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", help="config preset in configs/ (tiny, paper-3b, paper-9b, paper-27b, ...)")
    src.add_argument("--config", help="path to a RunConfig YAML")
    p.add_argument("--hardware", default="h800", help=f"one of {', '.join(hardware_names())}, or a profile .json")
    p.add_argument("--gpus", type=int, required=True, help="GPUs of the run: pipeline ranks x data-parallel replicas")
    p.add_argument("--memory-gib", type=float, help="memory budget per GPU in GiB (default: the hardware's)")
    p.add_argument("--global-batch", type=int,
                   help="sequences per optimizer step, kept fixed (default: the config's parallel.microbatches x "
                        "microbatch_size; e.g. 1280 for the paper's 27B run)")
    p.add_argument("--schedules", default=None, help="schedule kinds to search, comma-separated (default: all: "
                   f"{','.join(names())})")
    p.add_argument("--microbatch-sizes", default="1,2,4", help="sequences per micro-batch to search")
    p.add_argument("--recompute", default="off,auto,1,2,4,8",
                   help="recompute choices: off, auto (Eq. 20 per stage), block sizes in sub-layers")
    p.add_argument("--hp", default="on,off", help="MLP post+res on the high-priority stream: on, off or both")
    p.add_argument("--even-only", action="store_true", help="only layouts whose stages divide the blocks")
    p.add_argument("--splits", default="even,balanced",
                   help="how blocks are cut into stages: even (the runtime's default cut), balanced (by cost, "
                        "costmodel.pricing.stage_split; written as parallel.stage_split), or both (default)"),
    p.add_argument("--distributed-optimizer", default="off,on",
                   help="optimizer state whole on every rank (off) or sharded over the data-parallel ranks (on, "
                        "ZeRO-1 as Megatron's distributed optimizer; train.distributed_optimizer), or both")
    p.add_argument("--json", metavar="TUNE.json", help="write the front, the best layout and the ties as JSON")
    p.add_argument("-o", "--output", metavar="BEST.yaml", help="write the fastest runnable layout as a config")
    p.set_defaults(func=run)


def _list(flag: str, text: str, allowed=None, integer: bool = False) -> list[str]:
    items = [t.strip().lower() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"{flag} {text!r}: give a comma-separated list")
    for t in items:
        ok = (allowed is not None and t in allowed) or (integer and t.isdigit() and int(t) >= 1)
        if not ok:
            want = ", ".join(allowed or []) + (" or positive integers" if integer else "")
            raise ValueError(f"{flag} {text!r}: {t!r} is not one of {want.lstrip(', ')}")
    return list(dict.fromkeys(items))


def _check_output(path: str | None) -> Path | None:
    if path is None:
        return None
    out = Path(path)
    if not path.strip() or out.is_dir() or out.suffix not in (".yaml", ".yml"):
        raise ValueError(f"-o/--output {path!r}: give a file name ending in .yaml, e.g. best.yaml")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"-o/--output {path}: cannot create its folder ({err.strerror}); choose a writable path") \
            from None
    return out


def load(args: argparse.Namespace):
    from configs import load_config_data, parse_config

    source = args.config or args.preset
    if source is None:
        raise ValueError("give --preset NAME or --config FILE.yaml")
    flag = "--config" if args.config else "--preset"
    try:
        data, path = load_config_data(source)
        return parse_config(data, str(path)), data
    except ValueError as err:
        raise ValueError(f"{flag} {source}: {err}") from None


def run(args: argparse.Namespace) -> int:
    from costmodel.physics.hardware import get_hardware

    t0 = time.perf_counter()
    out = _check_output(args.output)
    if args.json is not None and Path(args.json).suffix != ".json":
        raise ValueError(f"--json {args.json!r}: give a file name ending in .json, e.g. tune.json")
    cfg, data = load(args)
    try:
        hw = get_hardware(args.hardware)
    except ValueError as err:
        raise ValueError(f"--hardware {args.hardware}: {err}") from None
    memory = hw.memory_bytes / 2**30 if args.memory_gib is None else args.memory_gib
    if not (math.isfinite(memory) and memory > 0):
        raise ValueError(f"--memory-gib {args.memory_gib:g}: must be a positive number of GiB per GPU")
    G = args.global_batch if args.global_batch is not None else cfg.parallel.microbatches * cfg.parallel.microbatch_size
    space = dict(
        schedules=tuple(_list("--schedules", args.schedules or ",".join(names()), allowed=list(names()))),
        microbatch_sizes=tuple(int(b) for b in _list("--microbatch-sizes", args.microbatch_sizes, integer=True)),
        recompute=tuple(_list("--recompute", args.recompute, allowed=["off", "auto"], integer=True)),
        hp=tuple(h == "on" for h in _list("--hp", args.hp, allowed=["on", "off"])),
        allow_uneven=not args.even_only,
        splits=tuple(_list("--splits", args.splits, allowed=["even", "balanced"])),
        distributed_optimizer=tuple(z == "on" for z in _list("--distributed-optimizer", args.distributed_optimizer,
                                                             allowed=["off", "on"])))
    check_inputs(cfg, args.gpus, G, space)
    from costmodel.answers.tune import tune

    result = tune(cfg, data, hw, args.gpus, memory, G, **space)
    if result.best is None:
        raise ValueError(no_fit_message(result, memory))
    print(format_result(result, cfg, hw, args.gpus, memory, G, time.perf_counter() - t0))
    if args.json:
        print(f"wrote {write_json(result, args.json, memory)}")
    if out is not None:
        write_best(result, out, args)
        print(f"wrote {out}: mhcpipe predict --config {out}; mhcpipe run --config {out} "
              f"(world {args.gpus} = pp {result.best.cand.pp} x dp {result.best.cand.dp})")
    return 0


def _layout_exists(nb: int, gpus: int, G: int, space: dict) -> bool:
    """Arithmetic only (no schedule is built): some P dividing `gpus` fills its stages and some micro-batch
    size splits G into micro-batches that the D = gpus / P replicas share evenly."""
    for pp in range(1, gpus + 1):
        if gpus % pp:
            continue
        stages = [kind_of(k).model_chunks(pp) for k in space["schedules"]]
        if min(stages) > nb or (not space["allow_uneven"] and all(nb % s for s in stages if s <= nb)):
            continue
        if any(G % b == 0 and (G // b) % (gpus // pp) == 0 for b in space["microbatch_sizes"]):
            return True
    return False


def check_inputs(cfg, gpus: int, G: int, space: dict) -> None:
    """One line naming the flag and what would fit, before the search. Both fixes are given; the flag named
    first is the value with fewer divisors (a prime GPU count, or a global batch that splits no way)."""
    from costmodel.answers.tune_space import divisors

    nb = cfg.model.num_blocks
    if gpus < 1:
        raise ValueError(f"--gpus {gpus}: must be >= 1")
    if G < 1:
        raise ValueError(f"--global-batch {G}: must be >= 1 sequence")
    if _layout_exists(nb, gpus, G, space):
        return
    sizes = ",".join(map(str, space["microbatch_sizes"]))
    near_g = [g for d in range(1, 4 * gpus) for g in (gpus - d, gpus + d) if g >= 1 and _layout_exists(nb, g, G, space)]
    near_b = [b for d in range(1, 4 * G) for b in (G - d, G + d) if b >= 1 and _layout_exists(nb, gpus, b, space)]
    why = (f"no P pipeline ranks dividing {gpus} GPUs (filling at most {nb} stages, model.num_blocks) leave "
           f"D = {gpus} / P replicas that share the {G} sequences' micro-batches (of {sizes}) evenly")
    batches = f"global batches that fit {gpus} GPUs: {', '.join(map(str, near_b[:2])) or 'none'}"
    counts = f"GPU counts that fit {G} sequences: {', '.join(map(str, near_g[:2])) or 'none'}"
    if len(divisors(G)) < len(divisors(gpus)):
        raise ValueError(f"--global-batch {G}: {why}; {batches}; or {counts}")
    raise ValueError(f"--gpus {gpus}: {why}; {counts}; or --global-batch: {batches}")


def no_fit_message(result, memory: float) -> str:
    small = result.smallest
    if small is None:
        return ("no layout passes the schedules' rules (micro-batches per replica >= ranks, DualPipe's even and "
                ">= 2P): give a larger --global-batch or more --schedules")
    return (f"--memory-gib {memory:g}: no layout fits; the smallest needs {small.memory_gib:.1f} GiB per GPU "
            f"({small.cand.label()})")


def _lr(result, ev) -> str:
    blocks = result.tuner.recompute_key(ev.cand) if result.tuner else ()
    vals = sorted({b for b in blocks if b})
    return "-" if not vals else ",".join(map(str, vals))


def format_result(result, cfg, hw, gpus: int, memory: float, G: int, seconds: float) -> str:
    r = cfg.model.residual
    c = result.counts
    lines = [f"tune {cfg.model.name} ({r.variant} n={r.n}) on {hw.name}: {gpus} GPUs, {memory:g} GiB per GPU, global "
             f"batch {G} sequences x {cfg.parallel.seq_len} tokens",
             f"searched {c['layouts']} layouts: {c['same per-stage L_r as another recompute choice']} same per-stage "
             f"L_r as another recompute choice, {c['over the memory budget']} over the memory budget, "
             f"{c['bounded out']} bounded out (per-rank lower bound >= a simulated layout with no more memory), "
             f"{c['simulated']} simulated; {seconds:.1f} s",
             "Pareto front, step time vs peak memory per GPU (* = the best runnable layout, written with -o):",
             _header()]
    for e in result.front:
        lines.append(_row(result, e, "*" if e is result.best else " "))
    b = result.best
    lines.append(f"best: {b.cand.label()}: step {b.step_us / 1e3:,.1f} ms = pipeline {b.pipeline_us / 1e3:,.1f} + "
                 f"exposed gradient all-reduce {b.sync.exposed_us / 1e3:,.1f} ms (of {b.sync.busiest_us / 1e3:,.1f} "
                 f"ms on the busiest rank); {b.memory_gib:.1f} GiB per GPU")
    from costmodel.answers.tune_front import TIE_PCT

    ties = [e for e in result.ties if e is not b]
    if ties:
        lines.append(f"tied within +-{TIE_PCT:g}% of the best (the model's error band, costmodel.md §1): "
                     f"{len(result.ties)} layouts, most memory headroom first (headroom = {memory:g} GiB - peak):")
        lines.append(_header())
        for e in result.ties:
            lines.append(_row(result, e, "*" if e is b else " ") + f"  {memory - e.memory_gib:5.1f} GiB free")
    else:
        lines.append(f"no other runnable layout within +-{TIE_PCT:g}% of the best (the model's error band)")
    fastest = result.front[0]
    if fastest is not b:
        lines.append(f"fastest overall needs MLP post+res off the high-priority stream ({fastest.cand.label()}, "
                     f"{fastest.step_us / 1e3:,.1f} ms): the runtime has no switch for that (it always uses the hp "
                     "stream on CUDA), so the best runnable layout is the one written")
    ref = result.reference
    if ref is None:
        lines.append(f"{cfg.model.name}'s own layout is not in this search space on {gpus} GPUs")
    elif ref.sync is None:
        lines.append(f"{cfg.model.name}'s own layout ({ref.cand.label()}) needs {ref.memory_gib:.1f} GiB per GPU: "
                     "over the budget")
    else:
        lines.append(f"{cfg.model.name}'s own layout ({ref.cand.label()}): step {ref.step_us / 1e3:,.1f} ms, "
                     f"{ref.memory_gib:.1f} GiB per GPU; best is {100 * (1 - b.step_us / ref.step_us):.1f}% faster")
    lines.append("step = one replica's simulated pipeline (predict's mHC run) + the part of the gradient all-reduce "
                 "(ring over each chunk's replicas, fp32 gradients, posted after the chunk's last backward work) "
                 "that ends past the pipeline; optimistic: the all-reduce does not slow the compute it runs under, "
                 "the optimizer step is not priced")
    return "\n".join(lines)


def _header() -> str:
    return (f"  {'step ms':>10} {'pipeline':>10} {'grad AR':>8} {'GiB':>6}  {'schedule':<9} {'pp':>3} {'dp':>3} "
            f"{'ep':>3} {'mbs':>3} {'M/dp':>5} {'recompute':>9} {'L_r':>5}  hp  stages   dist-opt")


def _row(result, e, mark: str) -> str:
    k = e.cand
    return (f"{mark} {e.step_us / 1e3:10,.1f} {e.pipeline_us / 1e3:10,.1f} {e.sync.exposed_us / 1e3:8,.1f} "
            f"{e.memory_gib:6.1f}  {k.schedule:<9} {k.pp:>3} {k.dp:>3} {k.ep:>3} {k.microbatch_size:>3} "
            f"{k.per_replica:>5} {k.recompute:>9} {_lr(result, e):>5}  {'on ' if k.hp else 'off'} "
            f"{'balanced' if k.split == 'balanced' else 'uneven' if k.uneven else 'even':<8} "
            f"{'on' if k.distributed_optimizer else 'off'}")


def _json_row(result, e, memory: float) -> dict:
    return {"label": e.cand.label(), **dataclasses.asdict(e.cand), "step_ms": e.step_us / 1e3,
            "pipeline_ms": e.pipeline_us / 1e3, "exposed_grad_allreduce_ms": e.sync.exposed_us / 1e3,
            "memory_gib": e.memory_gib, "headroom_gib": memory - e.memory_gib, "recompute_blocks": _lr(result, e)}


def write_json(result, path: str, memory: float) -> Path:
    """The front (fastest first), the best runnable layout and the ties (tune.TIE_PCT, most headroom first)."""
    import json

    from costmodel.answers.tune_front import TIE_PCT

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {"memory_budget_gib": memory, "tie_pct": TIE_PCT, "counts": dict(result.counts),
            "best": _json_row(result, result.best, memory),
            "front": [_json_row(result, e, memory) for e in result.front],
            "ties": [_json_row(result, e, memory) for e in result.ties]}
    out.write_text(json.dumps(data, indent=1))
    return out


def write_best(result, out: Path, args: argparse.Namespace) -> None:
    import yaml

    b = result.best
    data = result.tuner.written(b.cand)
    head = [f"# written by: mhcpipe tune {' '.join(_argv(args))}",
            f"# predicted: step {b.step_us / 1e3:,.1f} ms = pipeline {b.pipeline_us / 1e3:,.1f} ms (one replica, "
            f"{b.cand.per_replica} micro-batches) + exposed gradient all-reduce {b.sync.exposed_us / 1e3:,.1f} ms; "
            f"peak {b.memory_gib:.1f} GiB per GPU",
            f"# world = parallel.ranks x parallel.data_parallel = {b.cand.pp * b.cand.dp} processes"]
    out.write_text("\n".join(head) + "\n" + yaml.safe_dump(data, sort_keys=False))


def _argv(args: argparse.Namespace) -> list[str]:
    out = []
    for flag in ("preset", "config", "hardware", "gpus", "memory_gib", "global_batch", "distributed_optimizer"):
        v = getattr(args, flag, None)
        if v is not None:
            out += [f"--{flag.replace('_', '-')}", f"{v:g}" if isinstance(v, float) else str(v)]
    return out
