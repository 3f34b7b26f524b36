"""Read a folder of torch Flight Recorder dumps (one pickle per rank) and name the ops a hang stopped at.

A dump (torch.distributed's Flight Recorder, written by NCCL's watchdog on a timeout, see
pipeline/observability/fr_setup.py) holds, per rank, the newest entries of every process group: op
(`profiling_name`, e.g. `nccl:send 0->1`), the group (`process_group` = (torch's name, description)), its
sequence number (`collective_seq_id` or `p2p_seq_id`), sizes and state. The pickle is read as data only:
`_DataUnpickler` allows no class or function at all (a dump is built of dicts, lists, tuples, strings, numbers,
booleans and None), so a forged file that names one is refused in one line, and nothing in it runs.

`analyse` compares the ranks of each group: for collectives, the highest sequence number each member posted
(members must post a group's collectives in one order, so the ranks at a lower number are the ones the others
wait for); for every rank, its entries that did not complete (NCCL tracks completion; gloo's entries say
nothing about it). The runtime's op ledgers (`actions_rank<r>.json`, next to the dumps) name the pipeline action
each (group, kind, sequence number) carried.
"""
from __future__ import annotations

import io
import json
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path

MAX_BYTES = 512 * 2**20  # a dump of 2,000 entries with stack frames is a few MiB; anything this big is not one
_DUMP_NAME = re.compile(r"^(?P<prefix>[A-Za-z_.\-]*?)(?P<rank>\d+)$")
_LEDGER_NAME = re.compile(r"^actions_rank(\d+)\.json$")


class FlightRecorderError(ValueError):
    """A file or folder that is not what it should be: one line naming it and the fix."""


class _DataUnpickler(pickle.Unpickler):
    """Builds containers and scalars only: every global lookup (class, function) is refused."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"it names {module}.{name}, and a Flight Recorder dump names no class or "
                                     "function")


def load_dump(path: Path) -> dict:
    """One rank's dump as plain data; FlightRecorderError (one line) for anything else."""
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise FlightRecorderError(f"{path}: {size} bytes, more than a Flight Recorder dump holds; not read")
    try:
        data = _DataUnpickler(io.BytesIO(path.read_bytes())).load()
    except Exception as err:  # noqa: BLE001 - every malformed pickle fails differently
        raise FlightRecorderError(f"{path}: not a Flight Recorder dump ({type(err).__name__}: {err}); pass the "
                                  "folder torch wrote with TORCH_FR_DUMP_TEMP_FILE") from None
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list) or "version" not in data:
        raise FlightRecorderError(f"{path}: a pickle, but not a Flight Recorder dump (no 'version' and 'entries')")
    for i, e in enumerate(data["entries"]):
        if not isinstance(e, dict) or not isinstance(e.get("process_group"), (list, tuple)) or \
                not isinstance(e.get("profiling_name"), str):
            raise FlightRecorderError(f"{path}: entry {i} is not a Flight Recorder entry (process_group, "
                                      "profiling_name)")
    return data


@dataclass
class Op:
    rank: int
    pg: str  # torch's name of the group
    desc: str
    kind: str  # "coll" or "p2p"
    seq: int
    name: str  # profiling_name, e.g. "nccl:all_reduce"
    state: str
    completed: bool
    sizes: list
    action: str = ""  # from the op ledger, when it has this (pg, kind, seq)

    def line(self) -> str:
        what = f" carrying {self.action}" if self.action else ""
        return (f"rank {self.rank}: {self.name} #{self.seq} on group {self.pg} ({self.desc}){what}, "
                f"state {self.state}, sizes {self.sizes}")


@dataclass
class FlightRecorderReport:
    folder: str
    ranks: list[int]
    entries: int
    groups: int
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        head = (f"{self.entries} Flight Recorder entries of ranks {self.ranks} on {self.groups} groups "
                f"({self.folder})")
        return f"ok: {head}, every group's members at the same op" if self.ok else \
            f"{len(self.problems)} problem(s): {head}"

    def to_dict(self) -> dict:
        return {"folder": self.folder, "ranks": self.ranks, "entries": self.entries, "groups": self.groups,
                "ok": self.ok, "problems": self.problems}


def is_dump_folder(path: Path) -> bool:
    """A folder holding Flight Recorder dumps (files named <prefix><rank>) rather than a trace of ours."""
    return path.is_dir() and any(_DUMP_NAME.match(p.name) and p.is_file() for p in path.iterdir())


def _ledgers(folder: Path) -> dict[tuple[int, str, str, int], str]:
    out = {}
    for p in folder.iterdir():
        m = _LEDGER_NAME.match(p.name)
        if not m:
            continue
        try:
            data = json.loads(p.read_text())
            for op in data["ops"]:
                out[(int(m.group(1)), str(op["pg"]), str(op["kind"]), int(op["seq"]))] = " + ".join(op["names"])
        except (ValueError, KeyError, TypeError) as err:
            raise FlightRecorderError(f"{p}: not an op ledger of ours ({type(err).__name__}: {err})") from None
    return out


def _ops(rank: int, data: dict, ledger: dict) -> list[Op]:
    ops = []
    for e in data["entries"]:
        pg, desc = (list(e["process_group"]) + ["", ""])[:2]
        p2p = bool(e.get("is_p2p"))
        seq = int(e.get("p2p_seq_id" if p2p else "collective_seq_id") or 0)
        kind = "p2p" if p2p else "coll"
        state = str(e.get("state", "?"))
        ops.append(Op(rank, str(pg), str(desc), kind, seq, e["profiling_name"], state, state == "completed",
                      e.get("input_sizes") or [], ledger.get((rank, str(pg), kind, seq), "")))
    return ops


def read_folder(folder: Path) -> dict[int, dict]:
    dumps = {}
    for p in sorted(folder.iterdir()):
        m = _DUMP_NAME.match(p.name)
        if m and p.is_file():
            dumps[int(m.group("rank"))] = load_dump(p)
    if not dumps:
        raise FlightRecorderError(f"{folder}: no Flight Recorder dumps (files named <prefix><rank>, e.g. rank_0)")
    return dumps


def analyse(folder: Path) -> FlightRecorderReport:
    dumps = read_folder(folder)
    ledger = _ledgers(folder)
    ops = [op for rank, data in dumps.items() for op in _ops(rank, data, ledger)]
    groups = sorted({op.pg for op in ops})
    problems = []
    for pg in groups:
        colls = [op for op in ops if op.pg == pg and op.kind == "coll"]
        members = sorted({op.rank for op in colls})
        if len(members) < 2:
            continue
        last = {r: max(op.seq for op in colls if op.rank == r) for r in members}
        top = max(last.values())
        behind = [r for r in members if last[r] < top]
        if behind:
            ahead = [op for op in colls if op.seq == top]
            lead = ahead[0]
            waits = "; ".join(f"rank {r} stopped at #{last[r]}" + _carrying(colls, r, last[r]) for r in behind)
            problems.append(f"group {pg} ({lead.desc}): ranks {sorted({op.rank for op in ahead})} posted "
                            f"{lead.name} #{top}{' carrying ' + lead.action if lead.action else ''} and wait for "
                            f"it; {waits}")
    for op in ops:
        if op.state in ("scheduled", "started") and not _gloo(op) and not op.completed:
            problems.append(f"not completed: {op.line()}")
    return FlightRecorderReport(str(folder), sorted(dumps), len(ops), len(groups), problems)


def _gloo(op: Op) -> bool:
    return op.name.startswith("gloo:")  # gloo's entries carry no completion state


def _carrying(colls: list[Op], rank: int, seq: int) -> str:
    for op in colls:
        if op.rank == rank and op.seq == seq:
            return f" ({op.name}{' carrying ' + op.action if op.action else ''})"
    return ""
