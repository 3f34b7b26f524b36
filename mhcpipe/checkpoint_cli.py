"""`mhcpipe checkpoint convert OLD_DIR NEW_DIR --config CONFIG`: an old-format checkpoint (stage<s>.pt +
latest.json) rewritten as the DCP checkpoint `mhcpipe run --resume` reads (pipeline.checkpoint.dcp.convert)."""
from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser("checkpoint", help="checkpoint tools: convert an old-format checkpoint to DCP")
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    c = sub.add_parser("convert", help="convert an old-format checkpoint (stage<s>.pt + latest.json) to DCP")
    c.add_argument("old_dir", type=Path)
    c.add_argument("new_dir", type=Path)
    c.add_argument("--config", required=True, help="the config (YAML path or preset) the old run used")
    c.set_defaults(func=_convert)


def _convert(args: argparse.Namespace) -> int:
    from configs import load_config
    from pipeline.checkpoint.dcp import convert

    out = convert(args.old_dir, args.new_dir, load_config(args.config))
    print(f"converted {args.old_dir} -> {out} (resume with --checkpoint-dir {args.new_dir} --resume)")
    return 0
