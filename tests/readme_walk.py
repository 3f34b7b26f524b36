"""Run every command the README shows, in its order, and fail when one fails: `make readme` (CI runs it after the tests
and the lint). tests/test_readme_commands.py checks in the suite that each command parses; this runs them.

The commands run in a scratch directory (the README's `runs/...` outputs land there, not in the checkout) that links
the project's `configs/` and `examples/`, with `.venv/bin` first on PATH, so `mhcpipe` and `torchrun` are the
project's. `make demo` runs its recipe (`mhcpipe demo`) there. What cannot run here is listed with the reason and not
run: `make test` and `make lint` (what CI runs before this walk), `make readme` (this walk) and a launch across
several nodes. Each command has its own deadline; the walk prints one line per command (seconds, exit code) and, for
a failure, the command's last lines of output.

    .venv/bin/python tests/readme_walk.py [--keep DIR] [--only SUBSTRING]

"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_readme_commands import COMMANDS  # noqa: E402 - the README's commands, parsed in one place

DEADLINE_S = 600
NOT_HERE = {
    "make test": "CI runs it before this walk",
    "make lint": "CI runs it before this walk",
    "make readme": "this walk",
}


def why_not_here(command: str) -> str | None:
    if command in NOT_HERE:
        return NOT_HERE[command]
    if "--nnodes" in command and "--nnodes 1" not in command:
        return "a launch across several nodes"
    return None


def as_run(command: str) -> str:
    """`make demo` is its recipe; the rest runs as written."""
    return "mhcpipe demo" if command == "make demo" else command


def walk(workdir: Path, only: str | None) -> int:
    (workdir / "configs").symlink_to(ROOT / "configs")
    (workdir / "examples").symlink_to(ROOT / "examples")  # the user-model commands name examples/*.py
    # the `local` hardware profile too lives in the scratch directory, not in the checkout's runs/hardware
    env = dict(os.environ, PATH=f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
               MHCPIPE_LOCAL_PROFILE=str(workdir / "runs" / "hardware" / "local.json"))
    failed = []
    for command in COMMANDS:
        if only and only not in command:
            continue
        reason = why_not_here(command)
        if reason:
            print(f"  skip  {command}  ({reason})", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(as_run(command), shell=True, cwd=workdir, env=env, capture_output=True, text=True,
                                  timeout=DEADLINE_S)
            code, out = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as err:
            code, out = "timeout", f"{err.stdout or ''}{err.stderr or ''}"
        took = time.perf_counter() - t0
        print(f"{took:6.1f}s {'ok' if code == 0 else f'FAILED ({code})':>6}  {command}", flush=True)
        if code != 0:
            failed.append(command)
            tail = out if isinstance(out, str) else out.decode(errors="replace")
            print("\n".join("        | " + ln for ln in tail.strip().splitlines()[-15:]), flush=True)
    if failed:
        print(f"readme walk: {len(failed)} README command(s) failed: " + "; ".join(failed), file=sys.stderr)
        return 1
    print("readme walk: every README command that can run on one machine ran")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keep", type=Path, help="run in this directory (created) and keep what the commands wrote")
    p.add_argument("--only", help="run only the commands that contain this text")
    args = p.parse_args(argv)
    if not (ROOT / ".venv" / "bin" / "mhcpipe").exists():
        print("readme walk: .venv/bin/mhcpipe is missing; run `make test` or `make demo` first (they create .venv)",
              file=sys.stderr)
        return 2
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=False)
        return walk(args.keep, args.only)
    workdir = Path(tempfile.mkdtemp(prefix="mhcpipe-readme-"))
    try:
        return walk(workdir, args.only)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
