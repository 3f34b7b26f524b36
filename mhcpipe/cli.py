"""`mhcpipe`: one command line, one subcommand module per capability.

Each module in SUBCOMMANDS defines `register(subparsers)`, which adds its parsers (the commands listed beside it)
and sets `func` to a callable taking the parsed args and returning an exit code. A command line naming a command
imports only that command's module (the others import schedules, traces and torch for nothing: ~0.6 s);
`mhcpipe --help` and an unknown command import them all (tests/test_cli_map.py keeps the list true). User errors
(bad flags, bad files) raise `CliError` or `ValueError`; they are printed as one line and exit 2, never as a
traceback.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys

SUBCOMMANDS = {
    "mhcpipe.schedule_cli": ("schedule",),
    "mhcpipe.demo": ("demo",),
    "mhcpipe.run_cli": ("run",),
    "mhcpipe.trace_cli": ("view", "compare"),
    "mhcpipe.convert_cli": ("convert",),
    "mhcpipe.analysis_cli": ("critical-path", "whatif", "overlap"),
    "mhcpipe.diagnose_cli": ("diagnose",),
    "mhcpipe.comm_cli": ("check-comm",),
    "mhcpipe.layout_cli": ("layout",),
    "mhcpipe.predict_cli": ("predict",),
    "mhcpipe.tune_cli": ("tune",),
    "mhcpipe.checkpoint_cli": ("checkpoint",),
    "mhcpipe.calibrate_cli": ("calibrate",),
    "mhcpipe.check_split_cli": ("check-split",),
}


class CliError(Exception):
    """A user-facing error: printed as `mhcpipe: error: ...` with exit code 2."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of `command` alone when it is one of SUBCOMMANDS'."""
    parser = argparse.ArgumentParser(prog="mhcpipe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    only = [m for m, names in SUBCOMMANDS.items() if command in names]
    for module_name in only or SUBCOMMANDS:
        importlib.import_module(module_name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    parser = build_parser(args_in[0] if args_in else None)
    args = parser.parse_args(args_in)
    if argv is None:  # a process of its own: what is imported now lives as long as it, so the collector stops
        gc.freeze()  # walking it; and it runs every 100,000 allocations instead of 700: the commands make millions
        gc.set_threshold(100_000, 50, 100)  # of small objects, few of them cyclic (tune 20 -> 13 s, same peak RSS)
    try:
        return int(args.func(args) or 0)
    except (CliError, ValueError, FileNotFoundError) as err:
        print(f"mhcpipe {args.command}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left (`mhcpipe ... | head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
