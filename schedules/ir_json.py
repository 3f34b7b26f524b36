"""Our JSON form of a `Schedule` (actions as torch-style strings, placement explicit), checked with pydantic."""
from __future__ import annotations

import json
from pathlib import Path

import pydantic

from schedules.ir import Action, Kind, Schedule, to_torch_str
from schedules.torch_csv import parse_action

FORMAT_NAME = "mhc-pipe-schedule"
FORMAT_VERSION = 1


class ScheduleFile(pydantic.BaseModel):
    """On-disk schedule. Actions use torch's text (`0F0`, `(0F3;7B1)OVERLAP_F_B`); P2P actions add `@peer`
    and carry the producer's stage on both sides, as in the IR."""

    model_config = pydantic.ConfigDict(extra="forbid")
    format: str = pydantic.Field(FORMAT_NAME, description=f"always {FORMAT_NAME!r}")
    version: int = pydantic.Field(FORMAT_VERSION, description="format version")
    kind: str = pydantic.Field(description="generator name or 'custom'")
    num_ranks: int = pydantic.Field(ge=1)
    num_microbatches: int = pydantic.Field(ge=1)
    stage_to_rank: list[int] = pydantic.Field(description="rank of every global stage")
    pipelines: list[list[int]] = pydantic.Field(description="ordered stage chains a micro-batch flows through")
    actions: list[list[str]] = pydantic.Field(description="per-rank program")


def _encode(a: Action) -> str:
    text = to_torch_str(a)
    return f"{text}@{a.peer}" if a.kind in (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B) else text


def _decode(text: str, where: str) -> Action:
    body, _, peer = text.partition("@")
    a = parse_action(body, where)
    if a is None:
        raise ValueError(f"{where}: empty action")
    if peer:
        a = a._replace(peer=int(peer))
    return a


def schedule_to_json(schedule: Schedule) -> str:
    data = ScheduleFile(kind=schedule.kind, num_ranks=schedule.num_ranks, num_microbatches=schedule.num_microbatches,
                        stage_to_rank=list(schedule.stage_to_rank), pipelines=[list(p) for p in schedule.pipelines],
                        actions=[[_encode(a) for a in acts] for acts in schedule.actions])
    return data.model_dump_json()


def schedule_from_json(text: str, source: str = "<json>") -> Schedule:
    try:
        data = ScheduleFile.model_validate_json(text)
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        raise ValueError(f"{source}: field {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    if data.format != FORMAT_NAME or data.version != FORMAT_VERSION:
        raise ValueError(f"{source}: format {data.format!r} version {data.version} is not "
                         f"{FORMAT_NAME!r} version {FORMAT_VERSION}")
    actions = tuple(tuple(_decode(t, f"{source} rank {r}") for t in acts) for r, acts in enumerate(data.actions))
    return Schedule(data.kind, data.num_ranks, data.num_microbatches, tuple(data.stage_to_rank),
                    tuple(tuple(p) for p in data.pipelines), actions)


def save_schedule(schedule: Schedule, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(schedule_to_json(schedule))
    return path


def load_schedule(path: str | Path) -> Schedule:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    try:
        json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err}); the file may be truncated") from None
    return schedule_from_json(text, str(path))
