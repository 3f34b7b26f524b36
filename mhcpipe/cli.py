"""`mhcpipe`: one command line, one subcommand module per capability.

Each module in SUBCOMMANDS defines `register(subparsers)`, which adds its parser and sets `func` to a callable
taking the parsed args and returning an exit code. User errors (bad flags, bad files) raise `CliError` or
`ValueError`; they are printed as one line and exit 2, never as a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

SUBCOMMANDS = (
    "mhcpipe.schedule_cli",
    "mhcpipe.demo",
    "mhcpipe.run_cli",
    "mhcpipe.trace_cli",
    "mhcpipe.analysis_cli",
    "mhcpipe.diagnose_cli",
    "mhcpipe.comm_cli",
    "mhcpipe.layout_cli",
    "mhcpipe.predict_cli",
    "mhcpipe.tune_cli",
    "mhcpipe.checkpoint_cli",
    "mhcpipe.calibrate_cli",
    "mhcpipe.check_split_cli",
)


class CliError(Exception):
    """A user-facing error: printed as `mhcpipe: error: ...` with exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mhcpipe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in SUBCOMMANDS:
        importlib.import_module(module_name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
