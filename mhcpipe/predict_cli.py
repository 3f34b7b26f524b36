"""`mhcpipe predict`: what mHC will cost before launch (time, overhead %, breakdown, memory, L_r).

The command's wiring: it parses the arguments and plugs costmodel.local's HostPricing into the analytic core,
so that `--hardware local` calibrated for this runtime is priced from its runtime profile.

Examples:
  mhcpipe predict --preset paper-27b --hardware h800 --pp 6 --schedule dualpipe --ep 8
  mhcpipe predict --preset paper-27b --hardware h800 --pp 8 --uneven --json out.json --trace-out pred.json
  mhcpipe predict --preset paper-27b --hardware h800 --variant xhc --n 16 --k 4
  mhcpipe predict --preset paper-27b --hardware h800 --sweep n=1..8 -o overhead_n.png
  mhcpipe predict --preset paper-27b --hardware h800 --sweep bw=12.5,25,50,100,200 -o overhead_bw.png
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from configs import presets
from costmodel.physics.hardware import hardware_names
from costmodel.local.host_pricing import HostPricing
from schedules.registry import names


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("predict", help="predict mHC's time, memory and traffic overhead before launch",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset",
                     help=f"config preset in configs/ ({', '.join(presets())})")
    src.add_argument("--config", help="path to a RunConfig YAML")
    p.add_argument("--hardware", default="h800", help=f"one of {', '.join(hardware_names())}, or a profile .json")
    p.add_argument("--pp", type=int, help="pipeline ranks P")
    p.add_argument("--schedule", help=", ".join(names()))
    p.add_argument("--ep", type=int, help="expert-parallel degree (must divide --dp)")
    p.add_argument("--dp", type=int, help="data-parallel replicas D (world = P x D; --microbatches counts the global "
                   "batch, M / D per replica)")
    p.add_argument("--distributed-optimizer", action="store_true",
                   help="optimizer state sharded over the data-parallel replicas (ZeRO-1, Megatron's "
                        "--use-distributed-optimizer)")
    p.add_argument("--microbatches", type=int, help="micro-batches M per step")
    p.add_argument("--seq-len", type=int, help="parallel.seq_len: tokens per sequence")
    p.add_argument("--fp8", choices=["on", "off"], help="train.fp8: the linear layers' GEMMs in FP8 (on) or bf16 (off)")
    p.add_argument("--fp8-storage", choices=["on", "off"],
                   help="train.fp8_storage: V3's FP8 activation-storage recipe, apart from the GEMMs "
                        "(default: as --fp8)")
    p.add_argument("--variant", choices=["residual", "hc", "mhc", "mhc-lite", "mhc-sp", "xhc"],
                   help="residual variant to price")
    p.add_argument("--n", type=int, help="residual streams n (N for xhc)")
    p.add_argument("--k", type=int, help="xhc: active streams k")
    p.add_argument("--unfused", action="store_true", help="price the unfused mHC kernels (mHC Table 2 I/O)")
    p.add_argument("--recompute", help="off | auto | an integer block size L_r (sub-layers)")
    p.add_argument("--fb-mode", default="streams", choices=["streams", "serial", "max"],
                   help="F&B step: kernels on streams (default), serial F+B, or max(F, B)")
    p.add_argument("--fb-order", default="runtime", choices=["runtime", "deepseek"],
                   help="issue order inside an F&B pair: the runtime's (default: forward first, weight gradients "
                        "last) or DeepSeek-V3 Fig. 4's (backward first, each weight gradient in place)")
    p.add_argument("--no-hp", action="store_true", help="MLP post+res on the normal stream (no high-priority stream)")
    p.add_argument("--sigma", type=float, help="extra compute slowdown under all-to-all beyond the SM carve-out "
                   "(default: the hardware's, 0)")
    p.add_argument("--comm-sms", type=int, help="SMs the all-to-all kernels occupy while they run (default: the "
                   "hardware's, 20 = DeepEP's default)")
    p.add_argument("--no-corun", action="store_true", help="one compute kernel at a time: no co-running of "
                   "memory-bound kernels on the hp stream with GEMMs")
    p.add_argument("--p2p", default="rendezvous", choices=["rendezvous", "commit", "dataflow"],
                   help="stage-boundary P2P: sends posted when produced (this runtime, default), at their program "
                   "point after the action (DualPipe's commit), or dataflow (receives always posted: lower bound)")
    p.add_argument("--ep-per-node", type=int, help="EP ranks per node (default: as many as fit); fewer sends part "
                   "of every all-to-all over the inter-node network")
    p.add_argument("--dispatcher", default="deepep", choices=["deepep", "alltoall"],
                   help="an EP group over nodes: deepep = a token crosses the network once per remote node (DeepEP); "
                        "alltoall = every token copy crosses on its own (an NCCL all-to-all)")
    p.add_argument("--uneven", action="store_true", help="allow stages with different block counts")
    p.add_argument("--split", choices=["even", "balanced"], default="even",
                   help="blocks per stage: 'even' (the runtime's split) or 'balanced' by cost (the ends' embedding, "
                        "head and MTP and DualPipe's two chunks per rank counted; costmodel/pricing/stage_split.py)")
    p.add_argument("--json", metavar="FILE", help="write the summary as JSON")
    p.add_argument("--trace-out", metavar="FILE.json", help="write the predicted mHC trace (baseline next to it)")
    p.add_argument("--sweep", help="plot overhead curves over one input: n=1..8 (streams), bw= (PP link GB/s), "
                   "hbm= (TB/s), intra= / inter= (GB/s), sms= (all-to-all SMs), gap= (launch us)")
    p.add_argument("--breakdown", action="store_true",
                   help="split mHC's overhead into kernel traffic, recompute, n-fold boundary traffic and gradient "
                        "sync (two more simulations, each adding one mechanism)")
    p.add_argument("--explain", action="store_true",
                   help="mHC's overhead from naive eager kernels to this prediction, one mechanism at a time, and "
                        "which stated assumptions reproduce the paper's 6.7%% (-o waterfall.png, --json)")
    p.add_argument("--sensitivity", nargs="?", const=20.0, type=float, metavar="PCT",
                   help="overhead range when each input moves -+PCT%% (default 20), sorted by swing "
                        "(-o tornado.png, --json)")
    p.add_argument("-o", "--output", metavar="FILE.png",
                   help="sweep picture (default predict_sweep.png), --explain waterfall or --sensitivity tornado")
    p.set_defaults(func=run)


def _overrides(args: argparse.Namespace) -> dict:
    par: dict = {}
    for flag, field in (("pp", "ranks"), ("schedule", "schedule"), ("ep", "expert_parallel"),
                        ("dp", "data_parallel"), ("microbatches", "microbatches"), ("seq_len", "seq_len")):
        v = getattr(args, flag, None)
        if v is not None:
            par[field] = v
    out: dict = {"parallel": par} if par else {}
    train: dict = {}
    if getattr(args, "distributed_optimizer", False):
        train["distributed_optimizer"] = True
    if getattr(args, "fp8", None) is not None:
        train["fp8"] = args.fp8 == "on"
    if getattr(args, "fp8_storage", None) is not None:
        train["fp8_storage"] = args.fp8_storage == "on"
    if train:
        out["train"] = train
    if args.recompute is not None:
        r = args.recompute.strip().lower()
        if r in ("off", "auto"):
            out["recompute"] = {"mode": r, "block_size": None}
        else:
            try:
                size = int(r)
            except ValueError:
                raise ValueError(f"--recompute: {args.recompute!r} is not off, auto or an integer block size") from None
            if size < 1:
                raise ValueError(f"--recompute: block size must be >= 1, got {size}")
            out["recompute"] = {"mode": "block", "block_size": size}
    return out


def load(args: argparse.Namespace):
    from configs import load_config

    source = args.config or args.preset
    if source is None:
        raise ValueError("give --preset NAME or --config FILE.yaml")
    return load_config(source, _overrides(args))


# --sweep keys: what each moves, its unit, and whether its values are integers
SWEEPS = {"n": ("n (residual streams)", "", True), "bw": ("PP link bandwidth (GB/s per direction)", "GB/s", False),
          "hbm": ("HBM bandwidth (TB/s)", "TB/s", False), "intra": ("intra-node bandwidth (GB/s)", "GB/s", False),
          "inter": ("inter-node bandwidth (GB/s)", "GB/s", False), "sms": ("all-to-all SMs", "", True),
          "gap": ("kernel launch gap (us)", "us", False)}
SWEEP_HELP = "n=1..8, bw=12.5,25,50, hbm=2,3.35,4.8, intra=100,200,400, inter=25,50,100, sms=8,20,32 or gap=1,2,4"


def _parse_sweep(text: str) -> tuple[str, list[float]]:
    key, sep, values = text.partition("=")
    key = key.strip().lower()
    if not sep or key not in SWEEPS:
        raise ValueError(f"--sweep {text!r}: write one of {SWEEP_HELP}")
    integer = SWEEPS[key][2]
    try:
        if ".." in values:
            lo, hi = (int(v) for v in values.split(".."))
            if hi < lo:
                raise ValueError(f"--sweep {text!r}: the range runs from {lo} down to {hi}; write {hi}..{lo}")
            vals = [float(v) for v in range(lo, hi + 1)]
        else:
            vals = [float(v) for v in values.split(",") if v.strip()]
    except ValueError as err:
        if str(err).startswith("--sweep"):
            raise
        what = "integers" if integer else "numbers"
        raise ValueError(f"--sweep {text!r}: values must be {what} ({SWEEP_HELP})") from None
    if not vals or not all(math.isfinite(v) and v > 0 for v in vals):
        raise ValueError(f"--sweep {text!r}: need finite positive values")
    if integer and any(v != int(v) for v in vals):
        raise ValueError(f"--sweep {text!r}: {SWEEPS[key][0]} must be integers")
    return key, vals


# sweep keys that add a physical resource: more of it must never make anything slower
RESOURCE_SWEEPS = ("bw", "hbm", "intra", "inter")


def sweep_times(pred) -> dict[str, float]:
    """What more of a resource must never raise: both step makespans, both F&B stages and every F&B pair kind
    priced alone (inputs on time), baseline and mHC (us)."""
    out = {f"{name} step": pred.summary["iteration_us"][name] for name in ("baseline", "mhc")}
    for name in ("baseline", "mhc"):
        fb = pred.summary["fb_stage_us"][name]
        if fb is not None:
            out[f"{name} F&B stage"] = fb
    for row in pred.summary["fb_pairs"]:
        for name in ("baseline", "mhc"):
            v = row["alone_us"][name]
            if v == v:  # not NaN
                out[f"{name} F&B pair F{row['f_stage']}/B{row['b_stage']}"] = v
    return out


def monotone_warnings(points: list[tuple[float, dict[str, float]]], label: str, rel: float = 1e-9) -> list[str]:
    """One WARNING line per time that rises between neighbouring sweep points as the resource grows (float noise
    below `rel` ignored): the cost model's physics must be monotone (issue 32, overlap.py "Monotone physics")."""
    pts = sorted(points, key=lambda p: p[0])
    rises: dict[str, list[str]] = {}
    for (v0, t0), (v1, t1) in zip(pts, pts[1:]):
        for name, b in t1.items():
            a = t0.get(name)
            if a is not None and v1 > v0 and b > a * (1 + rel):
                rises.setdefault(name, []).append(f"{v0:g} -> {v1:g}: {a / 1e3:.3f} -> {b / 1e3:.3f} ms "
                                                  f"(+{100 * (b / a - 1):.3f}%)")
    return [f"WARNING: non-monotone: {name} rises with more {label} at {'; '.join(where)}"
            for name, where in rises.items()]


def _check_output(flag: str, path: str | None, suffix: str) -> Path | None:
    """Refuse an output path before minutes of work rather than after: empty, a directory, or a missing parent
    that cannot be made."""
    if path is None:
        return None
    if not path.strip():
        raise ValueError(f"{flag}: empty path; give a file name such as out{suffix}")
    out = Path(path)
    if out.is_dir():
        raise ValueError(f"{flag} {path}: is a directory; give a file name such as {out / ('out' + suffix)}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot create its folder ({err.strerror}); choose a writable path") from None
    existed = out.exists()
    try:
        with open(out, "a"):
            pass
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot write there ({err.strerror}); choose a writable path") from None
    if not existed:
        out.unlink()
    return out


def run(args: argparse.Namespace) -> int:
    from costmodel.physics.hardware import get_hardware
    from costmodel.answers.predict import Options, predict, residual_spec_of
    from costmodel.answers.prediction_report import format_table, write_json

    if args.sigma is not None and not (math.isfinite(args.sigma) and args.sigma >= 0):
        raise ValueError(f"--sigma {args.sigma}: the compute slowdown under all-to-all must be a finite number >= 0 "
                         "(0 = no interference; the hardware's own value when omitted)")
    reports = [f for f, on in (("--sweep", args.sweep), ("--explain", args.explain),
                               ("--sensitivity", args.sensitivity is not None)) if on]
    if len(reports) > 1:
        raise ValueError(f"{reports[0]} and {reports[1]} are separate reports; give one of them per command")
    if reports and args.trace_out:
        raise ValueError(f"--trace-out writes a plain prediction's traces; drop it or drop {reports[0]}")
    if args.sensitivity is not None:
        from costmodel.answers.sensitivity import check_pct

        check_pct(args.sensitivity)
    _check_output("--json", args.json, ".json")
    _check_output("--trace-out", args.trace_out, ".json")
    _check_output("-o/--output", args.output, ".png")
    for flag, v in (("--n", args.n), ("--k", args.k)):
        if v is not None and v < 1:
            raise ValueError(f"{flag} {v}: {'residual streams' if flag == '--n' else 'active streams'} must be >= 1")
    cfg = load(args)
    hw = get_hardware(args.hardware)
    if args.comm_sms is not None and not 0 <= args.comm_sms < hw.sms:
        raise ValueError(f"--comm-sms {args.comm_sms}: must be >= 0 and below the {hw.name}'s {hw.sms} SMs")
    if args.ep_per_node is not None and args.ep_per_node < 1:
        raise ValueError(f"--ep-per-node {args.ep_per_node}: EP ranks per node must be >= 1")
    opts = Options(fb_mode=args.fb_mode, fb_order=args.fb_order, hp_stream=not args.no_hp, sigma=args.sigma,
                   allow_uneven=args.uneven, split=args.split,
                   comm_sms=args.comm_sms, corun=not args.no_corun, p2p=args.p2p, ep_per_node=args.ep_per_node,
                   dispatcher=args.dispatcher)
    spec = residual_spec_of(cfg, args.variant, args.n, args.k, fused=not args.unfused)
    if args.sweep:
        return _sweep(cfg, hw, spec, opts, args)
    if args.explain or args.sensitivity is not None:
        return _report(cfg, hw, spec, opts, args)
    pred = predict(cfg, hw, spec, opts, ladder=args.breakdown, profile_pricing=HostPricing())
    print(format_table(pred))
    if args.json:
        print(f"wrote {write_json(pred, args.json)}")
    if args.trace_out:
        out = Path(args.trace_out)
        pred.mhc.trace.save(out)
        base = out.with_name(out.stem + ".baseline" + out.suffix)
        pred.baseline.trace.save(base)
        print(f"wrote {out} (mHC) and {base} (baseline)")
    return 0


def _report(cfg, hw, spec, opts, args) -> int:
    """--explain (ladder + honest answer, waterfall) or --sensitivity (tornado): table, then -o and --json."""
    import json

    from costmodel.answers import charts as charts
    from costmodel.answers.predict import predict

    published = None

    if args.explain:
        from costmodel.answers.explain import explain, format_explain, to_json

        from costmodel.answers.published_road import format_road, road
        from costmodel.answers.published_road import to_json as road_json

        result = explain(cfg, hw, spec, opts, profile_pricing=HostPricing())
        print(format_explain(result))
        # a config with a published throughput (DeepSeek-V3's): the road from the roofline to it
        published = road(cfg, hw, opts, lambda c: predict(c, hw, spec, opts, ladder=False,
                                                          profile_pricing=HostPricing()))
        if published is not None:
            print(format_road(published))
        draw = charts.waterfall
    else:
        from costmodel.answers.sensitivity import format_sensitivity, sensitivity, to_json

        result = sensitivity(cfg, hw, spec, opts, args.sensitivity, profile_pricing=HostPricing())
        print(format_sensitivity(result))
        draw = charts.tornado
    if args.output:
        print(f"wrote {draw(result, args.output)}")
    if args.json:
        out = Path(args.json)
        data = to_json(result)
        if args.explain and published is not None:
            data["published_road"] = road_json(published)
        out.write_text(json.dumps(data, indent=1, default=str))
        print(f"wrote {out}")
    return 0


def _swept_hardware(hw, key: str, v: float):
    """The hardware spec with one resource set to `v` (in the unit SWEEPS names)."""
    if key == "hbm":
        return hw.model_copy(update={"hbm_bandwidth": v * 1e12})
    if key == "intra":
        return hw.model_copy(update={"intra": hw.intra.with_bandwidth(v * 1e9)})
    if key == "inter":
        return hw.model_copy(update={"inter": hw.inter.with_bandwidth(v * 1e9)})
    if key == "sms":
        if v >= hw.sms:
            raise ValueError(f"--sweep sms={v:g}: the all-to-all SMs must be fewer than the {hw.name}'s {hw.sms}")
        return hw.model_copy(update={"comm_sms": int(v)})
    return hw.model_copy(update={"launch_us": v, "bwd_launch_us": None if hw.bwd_launch_us is None
                                 else hw.bwd_launch_us * v / hw.launch_us})


def _sweep(cfg, hw, spec, opts, args) -> int:
    import dataclasses

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from traces.drawing.png import save_png
    from costmodel.physics.mhc_cost import ResidualSpec
    from costmodel.answers.predict import predict

    key, values = _parse_sweep(args.sweep)
    points = []  # every point is checked before the first (slow) prediction
    for v in values:
        if key == "n":
            n = int(v)
            s = ResidualSpec("residual", 1) if n == 1 else dataclasses.replace(
                spec, n=n, variant=spec.variant if spec.variant != "residual" else "mhc",
                k=min(spec.k, n) if spec.k else None)
            points.append((v, s, opts, hw))
        elif key == "bw":
            points.append((v, spec, dataclasses.replace(opts, pp_bandwidth=v * 1e9), hw))
        else:
            points.append((v, spec, opts, _swept_hardware(hw, key, v)))
    rows = []
    times = []  # per point: the times more of a physical resource must never raise (monotone_warnings)
    for v, s, o, h in points:
        pred = predict(cfg, h, s, o, ladder=True, profile_pricing=HostPricing())  # the curves are the split
        b = pred.summary["breakdown_pp"]
        rows.append((v, pred.summary["step_overhead_pct"], b["kernel_traffic"], b["recompute"], b["exposed_comm"],
                     b["gradient_sync"], pred.summary["memory_gib"]["mhc"]))
        times.append((v, sweep_times(pred)))
    label = SWEEPS[key][0]
    print(f"{label:<40} step overhead   kernels  recompute  boundary  grad sync   memory")
    for v, o, k, r, e, g, m in rows:
        print(f"{v:<40g} {o:12.2f}%  {k:+7.2f}  {r:+8.2f}  {e:+8.2f}  {g:+8.2f}  {m:6.1f} GiB")
    if key in RESOURCE_SWEEPS:
        for line in monotone_warnings(times, label):
            print(line)
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    xs = [r[0] for r in rows]
    ax.plot(xs, [r[1] for r in rows], "o-", label="step overhead (the sum)")
    ax.plot(xs, [r[2] for r in rows], "s--", label="kernel traffic")
    ax.plot(xs, [r[3] for r in rows], "^--", label="recompute")
    ax.plot(xs, [r[4] for r in rows], "v--", label="n-fold boundary traffic")
    if any(abs(r[5]) > 1e-9 for r in rows):
        ax.plot(xs, [r[5] for r in rows], "d--", label="gradient sync")
    if key in RESOURCE_SWEEPS:
        ax.set_xscale("log")
    # ticks at the swept values only (a log axis's own minor labels collide), each labelled as given
    from matplotlib.ticker import NullFormatter, NullLocator

    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{v:g}" for v in xs], fontsize=8)
    ax.set_xlabel(label)
    ax.set_ylabel("% of the baseline step")
    ax.set_title(f"{cfg.model.name} on {hw.name}: predicted mHC overhead")
    ax.grid(alpha=0.3)
    ax.legend()
    print(f"wrote {save_png(fig, args.output or 'predict_sweep.png')}")
    return 0
