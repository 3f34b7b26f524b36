"""The CUDA program of a rank: what its host issued to the GPU, in host order (docs/cuda_program.md).

The emulated CUDA device (pipeline.device.emulated) writes one file per rank, `cuda_program_rank<r>.json`, into a
run's trace folder; `mhcpipe check-comm --cuda DIR` replays all ranks' files under CUDA's and NCCL's rules
(traces.analysis.cuda_replay). A file is read as data only: JSON, each instruction checked field by field, and a
file that is not one is refused in one line naming the file, the instruction and the field.

Instruction kinds (`op`), each with the pipeline action the issuing host thread was in (`at`, may be empty):
    stream      a stream made: id, flags "blocking" | "non-blocking", priority, role (compute, hp, comm, end)
    kernel      work on a stream (name: the compute span, e.g. F/s0/mb1)
    record      an event recorded on a stream
    wait_event  a stream ordered behind an event
    nccl        one NCCL launch (a batch of P2P ops or one collective) posted from `stream` on communicator `comm`
                (members: global ranks), with its ops [{kind, peer?, name}] and the storages it reads or writes
    wait_nccl   a stream ordered behind an NCCL launch's end (Work.wait() in stream-ordered mode)
    host_wait   the host blocks until an event, or an NCCL launch, completed (a synchronize, a polled query)
    release     the host let go of a storage (no Python reference left: the caching allocator may reuse it for
                later work of `stream`, the stream that allocated it; default 0)
    mark        a point in the program (the end of the start-up warm-up, a step's start)
Stream 0 is the legacy default stream (compute), never declared.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from traces.trace import TraceError

FORMAT = "mhcpipe.cuda-program"
VERSION = 1
FILE_RE = re.compile(r"cuda_program_rank(\d+)\.json")
LEGACY = 0  # the legacy default stream's id in every program
P2P_KINDS = ("send", "recv")
COLLECTIVES = ("all_reduce", "all_gather", "all_to_all", "broadcast", "reduce_scatter", "barrier", "gather")
_FIELDS: dict[str, dict[str, type | tuple]] = {  # op -> field -> type
    "stream": {"stream": int, "flags": str, "priority": int, "role": str},
    "kernel": {"stream": int, "name": str},
    "record": {"stream": int, "event": int},
    "wait_event": {"stream": int, "event": int},
    "nccl": {"stream": int, "id": int, "comm": str, "members": list, "ops": list, "storages": list},
    "wait_nccl": {"stream": int, "id": int},
    "host_wait": {},
    "release": {"storage": int},
    "mark": {"name": str},
}


@dataclass(frozen=True)
class Program:
    rank: int
    world: int
    instructions: list[dict]
    source: str
    complete: bool = True  # False: the run failed; the host was blocked at the end of the program


def program_path(folder: Path, rank: int) -> Path:
    return Path(folder) / f"cuda_program_rank{rank}.json"


def write_program(path: Path, rank: int, world: int, instructions: list[dict], complete: bool = True) -> None:
    """`complete=False`: the run failed and the program ends where the rank stopped (its host blocked there)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": FORMAT, "version": VERSION, "rank": rank, "world": world, "complete": complete}
    with open(path, "w") as f:  # one instruction per line: a reader can diff two programs
        f.write(json.dumps(doc)[:-1] + ', "program": [\n')
        f.write(",\n".join(json.dumps(i, separators=(",", ":")) for i in instructions))
        f.write("\n]}\n")


def load_programs(folder: Path) -> list[Program]:
    """Every rank's program in `folder` (a run's trace folder), ranks 0..world-1 all present."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TraceError(f"{folder}: not a folder (pass the --trace-dir of a run made with --emulate-cuda)")
    files = sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := FILE_RE.fullmatch(p.name)))
    if not files:
        raise TraceError(f"{folder}: no cuda_program_rank<r>.json files (run with --emulate-cuda --trace-dir "
                         f"{folder})")
    programs = [read_program(p) for _, p in files]
    world = programs[0].world
    ranks = [p.rank for p in programs]
    if ranks != list(range(world)) or any(p.world != world for p in programs):
        raise TraceError(f"{folder}: programs of ranks {ranks} (world {world}): every rank 0..{world - 1} must be "
                         "there, from one run")
    return programs


def read_program(path: Path) -> Program:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TraceError(f"{path}: not a CUDA program file ({err.__class__.__name__}: {err})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise TraceError(f"{path}: field 'format' must be {FORMAT!r} (a file written by --emulate-cuda)")
    if doc.get("version") != VERSION:
        raise TraceError(f"{path}: field 'version' is {doc.get('version')!r}; this reader reads version {VERSION}")
    for key in ("rank", "world"):
        if not isinstance(doc.get(key), int) or doc[key] < 0:
            raise TraceError(f"{path}: field {key!r} must be a non-negative integer")
    prog = doc.get("program")
    if not isinstance(prog, list):
        raise TraceError(f"{path}: field 'program' must be a list of instructions")
    for i, ins in enumerate(prog):
        _check(path, i, ins, doc["world"])
    complete = doc.get("complete", True)
    if not isinstance(complete, bool):
        raise TraceError(f"{path}: field 'complete' must be true or false")
    return Program(doc["rank"], doc["world"], prog, str(path), complete)


def _check(path: Path, i: int, ins, world: int) -> None:
    where = f"{path}: instruction {i}"
    if not isinstance(ins, dict) or ins.get("op") not in _FIELDS:
        raise TraceError(f"{where}: field 'op' must be one of {', '.join(_FIELDS)}")
    for key, typ in _FIELDS[ins["op"]].items():
        if not isinstance(ins.get(key), typ) or isinstance(ins.get(key), bool):
            raise TraceError(f"{where} ({ins['op']}): field {key!r} must be a {typ.__name__}")
    if ins["op"] == "stream" and ins["flags"] not in ("blocking", "non-blocking"):
        raise TraceError(f"{where}: field 'flags' must be 'blocking' or 'non-blocking'")
    if ins["op"] == "host_wait" and sum(isinstance(ins.get(k), int) for k in ("event", "id")) != 1:
        raise TraceError(f"{where} (host_wait): exactly one of 'event' (an event) or 'id' (an NCCL launch)")
    if ins["op"] == "nccl":
        members = ins["members"]
        if not members or any(not isinstance(m, int) or not 0 <= m < world for m in members):
            raise TraceError(f"{where} (nccl): field 'members' must list global ranks below {world}")
        for op in ins["ops"]:
            kind = op.get("kind") if isinstance(op, dict) else None
            if kind not in P2P_KINDS + COLLECTIVES or not isinstance(op.get("name"), str):
                raise TraceError(f"{where} (nccl): each of 'ops' needs 'kind' (one of "
                                 f"{', '.join(P2P_KINDS + COLLECTIVES)}) and 'name'")
            if kind in P2P_KINDS and op.get("peer") not in members:
                raise TraceError(f"{where} (nccl): a {kind} needs 'peer', one of the members {members}")
