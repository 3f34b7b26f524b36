"""Every command the README shows is one the project accepts: each `mhcpipe ...` line of its code blocks parses with
mhcpipe's own parser (the subcommand exists, every flag and choice is current), each `torchrun ... -m pipeline ...`
line (and `torchrun ... examples/SCRIPT.py ...`, a user's script) with the torchrun entry's flags, each `make X`
names a Makefile target, and every config file or preset a command names is in configs/. `make readme`
(tests/readme_walk.py, run by CI after the lint) runs them all in order; what each one does is its own test's
(tests/<package>/).

A README edit that renames a flag, drops a subcommand or cites a config that is gone fails here."""
from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STARTS = re.compile(r"\s*(\.venv/bin/)?(mhcpipe|torchrun|make) ")


def readme_commands(text: str) -> list[str]:
    """The commands in the README's fenced code blocks, continuation lines joined, trailing comments dropped."""
    out = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        buf = ""
        for line in block.splitlines():
            if not buf and not STARTS.match(line):
                continue
            buf = f"{buf} {line.strip()}" if buf else line.strip()
            if buf.endswith("\\"):
                buf = buf[:-1]
                continue
            out.append(" ".join(shlex.split(buf, comments=True)))
            buf = ""
    return out


COMMANDS = readme_commands((ROOT / "README.md").read_text())


def _parses(parser: argparse.ArgumentParser, argv: list[str]) -> str:
    """'' when argv parses, else argparse's message."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            parser.parse_args(argv)
        except SystemExit as stop:
            return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {stop.code}"
    return ""


def _check_configs(argv: list[str]) -> None:
    from configs import load_config

    for flag in ("--config", "--preset"):
        if flag in argv:
            name = argv[argv.index(flag) + 1]
            if name.startswith("runs/"):  # written by an earlier command of the README
                continue
            load_config(str(ROOT / name) if name.endswith(".yaml") else name)


def test_the_readme_shows_the_commands_this_test_walks():
    kinds = {c.split()[0].split("/")[-1] for c in COMMANDS}
    assert {"mhcpipe", "torchrun", "make"} <= kinds and len(COMMANDS) >= 30, COMMANDS


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_is_accepted(command):
    argv = shlex.split(command)
    tool = argv[0].split("/")[-1]
    if tool == "make":
        targets = re.findall(r"^([a-z]+):", (ROOT / "Makefile").read_text(), re.M)
        assert argv[1] in targets, f"`{command}`: no target {argv[1]!r} in the Makefile ({targets})"
        return
    if tool == "mhcpipe":
        from mhcpipe.cli import build_parser

        parser, args = build_parser(), argv[1:]
    else:  # torchrun [its flags] -m pipeline [ours], or torchrun [its flags] a user's SCRIPT.py [ours]
        from pipeline.__main__ import add_run_arguments

        parser = argparse.ArgumentParser(prog="python -m pipeline")
        add_run_arguments(parser)
        scripts = [a for a in argv if a.endswith(".py")]
        if scripts:
            assert (ROOT / scripts[0]).is_file(), f"`{command}`: no script {scripts[0]} in the project"
            args = argv[argv.index(scripts[0]) + 1:]
        else:
            assert "-m" in argv and argv[argv.index("-m") + 1] == "pipeline", command
            args = argv[argv.index("-m") + 2:]
    problem = _parses(parser, args)
    assert not problem, f"`{command}`: {problem}"
    _check_configs(args)
