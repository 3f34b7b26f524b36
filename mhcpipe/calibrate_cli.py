"""`mhcpipe calibrate`: measure this machine with short micro-benchmarks and save the `local` hardware spec, or
(`--from-trace`) fit a spec's efficiency curves and launch gap to a measured baseline run and save it as a profile
for `mhcpipe predict --hardware FILE.json` (costmodel.fitting.calibrate, costmodel.fitting.trace_fit,
costmodel.fitting.roofline_fit)."""
from __future__ import annotations

import argparse

from costmodel.physics.hardware import local_profile_path


def register(subparsers) -> None:
    ap = subparsers.add_parser("calibrate", help="measure this machine (the `local` spec), or fit a spec's "
                               "efficiencies to a measured trace (--from-trace)")
    ap.add_argument("--quick", action="store_true", help="a few sizes only (seconds)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    ap.add_argument("--no-p2p", action="store_true", help="skip the 2-process P2P sweep")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("-o", "--output", default=None, help=f"profile path (default {local_profile_path()}; with "
                    "--from-trace runs/hardware/<hardware>-fitted.json)")
    fit = ap.add_argument_group("fit a spec to a measured trace instead (costmodel.fitting.roofline_fit)")
    fit.add_argument("--from-trace", metavar="TRACE", help="a measured baseline (n = 1) run of this runtime: "
                     "trace.json of `mhcpipe run --trace-dir`, a Kineto JSON or an Nsight Systems .sqlite")
    src = fit.add_mutually_exclusive_group()
    src.add_argument("--preset", help="the traced run's config preset")
    src.add_argument("--config", help="the traced run's config YAML")
    fit.add_argument("--hardware", default="h800", help="the spec to fit (a built-in name or a profile .json)")
    ap.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from costmodel.fitting.calibrate import calibrate_local

    if args.from_trace:
        return _fit_main(args)
    spec = calibrate_local(args.quick, args.threads, not args.no_p2p, args.device)
    path = spec.save(args.output or local_profile_path())
    print(f"matmul peak {spec.peak_flops['fp32'] / 1e9:.1f} GFLOP/s, copy {spec.hbm_bandwidth / 1e9:.2f} GB/s, "
          f"launch fwd {spec.launch_us:.1f} us / bwd {spec.backward_launch_us:.1f} us per op, "
          f"P2P alpha {spec.intra.latency_us:.0f} us, bw {spec.intra.bandwidth / 1e9:.2f} GB/s, "
          f"{spec.host_cores} cores -> {path}")
    return 0


def _fit_main(args: argparse.Namespace) -> int:
    from costmodel.physics.hardware import PROFILE_DIR, get_hardware
    from costmodel.fitting.roofline_fit import RooflineFit, at_bound
    from costmodel.fitting.trace_fit import fit_trace
    from configs import load_config
    from traces.formats.io import load_trace

    source = args.config or args.preset
    if source is None:
        raise ValueError("--from-trace needs the traced run's config: --preset NAME or --config FILE.yaml")
    hw = get_hardware(args.hardware)
    fit = fit_trace(load_trace(args.from_trace), load_config(source), hw, RooflineFit())
    path = fit.hardware.save(args.output or PROFILE_DIR / f"{fit.hardware.name}.json")
    print(f"fitted {hw.name} to {len(fit.measured_us)} action keys of {args.from_trace}")
    scales = fit.hardware.meta["fit_scales"]
    print("scales: " + ", ".join(f"{k} {v:.3f}" for k, v in scales.items())
          + "  (efficiency curves x scale, capped at 1; launch gap x scale)")
    print(f"{'kind':<6}{'median |error| before':>24}{'after':>10}")
    for kind, (before, after) in fit.kind_errors().items():
        print(f"{kind:<6}{before:>23.1f}%{after:>9.1f}%")
    for k in at_bound(scales):
        print(f"WARNING: the {k} scale sits at its bound ({scales[k]:.3f}): {hw.name} is far from the traced "
              "machine there, or the trace is not of this config")
    print(f"wrote {path}; use it with: mhcpipe predict --hardware {path} ...")
    return 0
