"""mhcpipe.cli.SUBCOMMANDS names every command its modules register (a command line imports only its command's
module, so a command missing from the list would be unreachable but through `mhcpipe --help`)."""
from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from pathlib import Path

from mhcpipe.cli import SUBCOMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[1]


def test_each_module_registers_exactly_the_commands_listed_for_it():
    for module, names in SUBCOMMANDS.items():
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(module).register(sub)
        assert tuple(sub.choices) == names, module


def test_a_command_line_imports_only_its_command_and_help_lists_all():
    every = {n for names in SUBCOMMANDS.values() for n in names}
    full = build_parser()
    assert set(full._subparsers._group_actions[0].choices) == every
    probe = ("import sys; from mhcpipe.cli import build_parser; build_parser('schedule'); "
             "print(sorted(m for m in sys.modules if m.startswith('mhcpipe.') and m.endswith(('_cli', 'demo'))))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['mhcpipe.schedule_cli']"
