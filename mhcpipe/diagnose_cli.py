"""`mhcpipe diagnose`: stream-collapse diagnostics of one or more training runs, as a table and one PNG.

    mhcpipe diagnose RUN_DIR [RUN_DIR ...] -o diag.png [--label NAME ...] [--json out.json]

RUN_DIR is the trace dir of one variant (e.g. runs/x/mhc_4/, holding diagnostics_rank*.json written by a run
started with --diagnostics-every K) or a parent holding such variant dirs (each becomes a run). The table has one
row per run; each cell is "first -> last" logged step (one number when only one step was logged):

  imb max / imb out   stream RMS max/min: the largest over depth, and that of the deepest recorded state
  read / write        largest and smallest share of one stream in the read (H_pre) / write (H_post) weights
  |Hres-I| deep       mean ||H_res - I||_F over the deepest half of the sub-layers (near 0: near-identity)
  gain f / gain b     Amax gain (fwd row / bwd column sum) of the model composite of token-mean H_res
  stage gain b        largest per-token backward gain of a stage composite (mHC reports <= ~1.6, HC ~3000)
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from pipeline.observability.diagnose import draw, load, summary

_COLUMNS = (  # (header, key in a step summary, format)
    ("imb max", "imbalance_max", ".4g"), ("imb out", "imbalance_out", ".4g"),
    ("read max", "read_share_max", ".2f"), ("read min", "read_share_min", ".2f"),
    ("write max", "write_share_max", ".2f"), ("write min", "write_share_min", ".2f"),
    ("|Hres-I| deep", "res_identity_dist_deep", ".3g"),
    ("gain f", "gain_fwd", ".4g"), ("gain b", "gain_bwd", ".4g"), ("stage gain b", "stage_gain_bwd_max", ".4g"),
)


def register(subparsers) -> None:
    p = subparsers.add_parser("diagnose", help="stream-collapse diagnostics of training runs (--diagnostics-every): "
                              "table + PNG", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a variant's trace dir, or a dir of them")
    p.add_argument("-o", "--out", required=True, help="the PNG to write")
    p.add_argument("--label", action="append", default=[], metavar="NAME",
                   help="name of a run, once per run in order (default: the dir name)")
    p.add_argument("--json", dest="json_out", help="write the per-run summaries as JSON here")
    p.set_defaults(func=run_diagnose)


def _cell(first: dict, last: dict, key: str, fmt: str, trend: bool) -> str:
    def f(v: float) -> str:
        return "-" if isinstance(v, float) and math.isnan(v) else format(v, fmt)
    return f"{f(first[key])}->{f(last[key])}" if trend else f(last[key])


def table(summaries: list[dict]) -> str:
    head = ["run", "N", "L", "steps", *(h for h, _, _ in _COLUMNS)]
    rows = []
    for s in summaries:
        steps = s["steps_logged"]
        trend = len(steps) > 1
        rows.append([s["label"], str(s["streams"]), str(s["layers"]),
                     f"{steps[0]}->{steps[-1]}" if trend else str(steps[-1]),
                     *(_cell(s["first"], s["last"], k, fmt, trend) for _, k, fmt in _COLUMNS)])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *rows]]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]]) + "\n"


def _nan_to_null(v):
    """NaN (a number that does not exist, e.g. no stage composite) -> null; inf (a zero stream) stays Infinity."""
    if isinstance(v, float) and math.isnan(v):
        return None
    if isinstance(v, dict):
        return {k: _nan_to_null(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_nan_to_null(x) for x in v]
    return v


def run_diagnose(args: argparse.Namespace) -> int:
    runs = load(args.run_dirs, labels=args.label or None)
    sums = [summary(r) for r in runs]
    sys.stdout.write(table(sums))
    for s in sums:
        if s["missing_layers"]:
            sys.stdout.write(f"note: {s['label']}: sub-layers {s['missing_layers']} not logged at step "
                             f"{s['steps_logged'][-1]} (a rank's file missing?); the model composite skips them\n")
    out = draw(runs, args.out)
    sys.stdout.write(f"wrote {out}\n")
    if args.json_out:
        p = Path(args.json_out)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(_nan_to_null(sums), indent=1))
        sys.stdout.write(f"wrote {p}\n")
    return 0
