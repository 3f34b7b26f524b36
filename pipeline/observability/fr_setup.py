"""torch's Flight Recorder for our runs: its settings, and a ledger of which pipeline action each op carried.

Flight Recorder (torch.distributed) keeps the last entries of every process group's collectives and P2P ops in
memory: op, sizes, the group's sequence number, state (scheduled / started / completed). On NCCL, with
TORCH_NCCL_DUMP_ON_TIMEOUT=1, the watchdog writes each rank's buffer to `<prefix><rank>` (a pickle) when an op
passes the process-group timeout, and signals the other ranks to write theirs. `flight_recorder_env` turns it on
for every run (unless the user set the variables): the buffer size (TORCH_FR_BUFFER_SIZE: torch's Flight Recorder
reads it first and TORCH_NCCL_TRACE_BUFFER_SIZE only as a deprecated fallback, printing a warning on every rank when
that is set, so only torch older than 2.8 gets the old name too), dump on timeout, and the dump files in the run's
folder (TORCH_FR_DUMP_TEMP_FILE; TORCH_NCCL_DEBUG_INFO_TEMP_FILE as well, read silently).

What Flight Recorder cannot know is the pipeline action behind an op ("nccl:send 0->1, p2p seq 12" is
`SEND_F/s0/mb3`). pipeline.distributed.op_ledger records it as the runtime posts; `write_ledger` puts it next to
the dumps as `actions_rank<r>.json`, and `mhcpipe check-comm DIR` (traces/formats/flight_recorder.py) joins the two.
"""
from __future__ import annotations

import os
from pathlib import Path

from pipeline.device.poll import poll
from pipeline.distributed.op_ledger import LEDGER

BUFFER_ENTRIES = 2000  # per rank: a few steps of a pp16 DualPipeV rank's ops
DUMP_PREFIX = "rank_"


def flight_recorder_dir(trace_dir: str | None, env: dict) -> Path:
    """The run's folder for dumps and ledgers: <trace-dir>/flight_recorder, else runs/flight_recorder/<run id>
    (torchrun's TORCHELASTIC_RUN_ID, the same on every rank of the job)."""
    if trace_dir:
        return Path(trace_dir).resolve() / "flight_recorder"
    return Path("runs", "flight_recorder", env.get("TORCHELASTIC_RUN_ID") or "run").resolve()


def flight_recorder_env(folder: Path, env: dict) -> dict[str, str]:
    """Set what is unset of Flight Recorder's variables in `env` (os.environ, before init_process_group); returns
    what was set. A user's own value always wins."""
    wanted = {"TORCH_FR_BUFFER_SIZE": str(BUFFER_ENTRIES),
              "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": str(folder / DUMP_PREFIX),
              "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(folder / DUMP_PREFIX)}
    if _torch_older_than(2, 8):
        wanted["TORCH_NCCL_TRACE_BUFFER_SIZE"] = str(BUFFER_ENTRIES)
    done = {}
    for key, value in wanted.items():
        if key not in env:
            env[key] = done[key] = value
    return done


def _torch_older_than(major: int, minor: int) -> bool:
    import torch

    parts = torch.__version__.split("+")[0].split(".")
    try:
        return (int(parts[0]), int(parts[1])) < (major, minor)
    except (ValueError, IndexError):
        return False


def dump_prefix(env: dict) -> str | None:
    return env.get("TORCH_FR_DUMP_TEMP_FILE") or env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def wait_for_dump(prefix: str, rank: int, limit_s: float) -> bool:
    """After a deadline error on NCCL: give the watchdog up to `limit_s` to write this rank's dump."""
    path = f"{prefix}{rank}"
    return poll(lambda: os.path.exists(path) and os.path.getsize(path) > 0, limit_s)


def write_ledger(folder: Path, rank: int) -> Path:
    """This rank's ledger of posted ops, as actions_rank<r>.json in `folder`."""
    return LEDGER.write(folder, rank)


STORE_PREFIX = "mhcpipe/fr"


def share_files(store, key: str, rank: int, world: int, files: dict[str, bytes], limit_s: float) -> dict[str, bytes]:
    """Gather every rank's `files` ({name: bytes}) to rank 0 through `store` (torchrun's TCP store: it outlives a
    hung NCCL group, which a collective would not), under `key` (the run and its restart). Every rank publishes its
    own; rank 0 waits up to `limit_s` for the others' and returns {name: bytes} of every file that arrived (its own
    included); other ranks return {}. Ranks on other nodes write their dumps and ledgers to their own disks: this is
    how they reach rank 0's folder."""
    import datetime
    import json

    names = sorted(files)
    store.set(f"{key}/{rank}/names", json.dumps(names))
    for name in names:
        store.set(f"{key}/{rank}/file/{name}", files[name])
    store.set(f"{key}/{rank}/done", "1")
    if rank != 0:
        return {}
    got = dict(files)
    for r in range(1, world):
        try:
            store.wait([f"{key}/{r}/done"], datetime.timedelta(seconds=max(0.1, limit_s)))
        except Exception:  # noqa: BLE001 - a rank that died before publishing: what arrived is what there is
            continue
        for name in json.loads(store.get(f"{key}/{r}/names").decode()):
            got[name] = store.get(f"{key}/{r}/file/{name}")
    return got
