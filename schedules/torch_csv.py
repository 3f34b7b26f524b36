"""Read and write the per-rank CSV of `torch.distributed.pipelining` (`_dump_csv` / `_load_csv`).

One row per rank, one action string per cell (`0F0`, `2I0`, `1W3`, `(0F3;7B1)OVERLAP_F_B`, `3SEND_F1`), an
empty cell is a deliberate idle slot. In torch's text a RECV carries the *consumer's* stage (RECV_F of stage
s+1, RECV_B of stage s-1); our IR labels both sides of a transfer with the producer's stage, so the two are
converted here. torch releases before the I/W split used `B` for input-grad and `BW` for full backward: such
files are rejected, as are FSDP actions (UNSHARD, RESHARD, REDUCE_GRAD) that this project does not model.
"""
from __future__ import annotations

import csv
import re
from pathlib import Path

from schedules.ir import Action, Kind, Schedule, fb, to_torch_str

_SINGLE = re.compile(r"^(\d+)(F|I|W|B|SEND_F|RECV_F|SEND_B|RECV_B)(\d+)$")
_OVERLAP = re.compile(r"^\((\d+)F(\d+);(\d+)B(\d+)\)OVERLAP_F_B$")
_UNMODELLED = re.compile(r"^\d+(UNSHARD|RESHARD|REDUCE_GRAD)\d*$")
_OLD_SPELLING = re.compile(r"^\d+BW\d+$")


def _torch_text(a: Action, schedule: Schedule) -> str:
    if a.kind is Kind.RECV_F:
        return f"{schedule.next_stage()[a.stage]}RECV_F{a.mb}"
    if a.kind is Kind.RECV_B:
        return f"{schedule.prev_stage()[a.stage]}RECV_B{a.mb}"
    return to_torch_str(a)


def write_csv(schedule: Schedule, path: str | Path) -> Path:
    """Write `schedule` (compute-only or lowered) in torch's CSV format."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        for acts in schedule.actions:
            writer.writerow([_torch_text(a, schedule) for a in acts])
    return path


def parse_action(text: str, where: str = "") -> Action | None:
    """One cell of torch's CSV -> our Action (RECV stages still in torch's consumer convention); None if empty."""
    text = text.strip()
    if not text:
        return None
    if m := _OVERLAP.match(text):
        f_stage, f_mb, b_stage, b_mb = map(int, m.groups())
        return fb(f_stage, f_mb, b_stage, b_mb)
    if m := _SINGLE.match(text):
        stage, kind, mb = m.groups()
        return Action(Kind(kind), int(stage), int(mb))
    if _OLD_SPELLING.match(text):
        raise ValueError(f"{where}: {text!r} uses the pre-2.6 torch spelling (BW = full backward, B = input-grad); "
                         "re-export the schedule with a current torch, where B is full backward and I input-grad")
    if _UNMODELLED.match(text):
        raise ValueError(f"{where}: {text!r} is an FSDP/gradient-reduction action that mhc-pipe does not model; "
                         "export the compute_only format")
    raise ValueError(f"{where}: cannot read action {text!r}; expected e.g. 0F0, 2I0, 1W3, 3SEND_F1 or "
                     "(0F3;7B1)OVERLAP_F_B")


def read_csv(path: str | Path, kind: str | None = None) -> Schedule:
    """Read torch's CSV. Placement comes from the generator of `kind` when given (e.g. "dualpipe", whose two
    opposite pipelines a CSV cannot express), else it is inferred: each stage on the rank that computes it,
    stages 0..S-1 forming one pipeline (torch's convention)."""
    path = Path(path)
    rows: list[list[Action]] = []
    try:
        with path.open(newline="") as f:
            for r, row in enumerate(csv.reader(f)):
                acts = [parse_action(cell, f"{path.name} rank {r} column {c}") for c, cell in enumerate(row)]
                rows.append([a for a in acts if a is not None])
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text CSV file") from None
    if not rows:
        raise ValueError(f"{path}: empty schedule (expected one row of actions per rank)")

    stage_to_rank: dict[int, int] = {}
    max_mb = -1
    for r, acts in enumerate(rows):
        for a in acts:
            for p in a.parts():
                if p.kind in (Kind.F, Kind.I, Kind.W, Kind.B):
                    if stage_to_rank.setdefault(p.stage, r) != r:
                        raise ValueError(f"{path.name}: stage {p.stage} is computed on ranks {stage_to_rank[p.stage]}"
                                         f" and {r}; a stage must live on exactly one rank")
                    max_mb = max(max_mb, p.mb)
    if kind is not None:
        from schedules.build import build

        template = build(kind, len(rows), _template_microbatches(kind, len(rows), max_mb + 1))
        placement, pipelines = template.stage_to_rank, template.pipelines
        num_microbatches = (max_mb + 1) * len(pipelines)
        name = template.kind
    else:
        num_stages = max(stage_to_rank) + 1
        missing = sorted(set(range(num_stages)) - set(stage_to_rank))
        if missing:
            raise ValueError(f"{path.name}: stages {missing} have no compute actions; cannot infer their rank")
        placement = tuple(stage_to_rank[s] for s in range(num_stages))
        pipelines = (tuple(range(num_stages)),)
        num_microbatches = max_mb + 1
        name = "custom"
    schedule = Schedule(name, len(rows), num_microbatches, tuple(placement), pipelines, ())
    prev, nxt = schedule.prev_stage(), schedule.next_stage()
    actions = []
    for r, acts in enumerate(rows):
        converted = []
        for a in acts:
            if a.kind is Kind.RECV_F:  # torch: consumer stage; ours: producer stage and its rank
                producer = prev.get(a.stage)
                if producer is None:
                    raise ValueError(f"{path.name} rank {r}: {a.stage}RECV_F{a.mb} receives into a first stage")
                a = Action(Kind.RECV_F, producer, a.mb, peer=placement[producer])
            elif a.kind is Kind.RECV_B:
                producer = nxt.get(a.stage)
                if producer is None:
                    raise ValueError(f"{path.name} rank {r}: {a.stage}RECV_B{a.mb} receives into a last stage")
                a = Action(Kind.RECV_B, producer, a.mb, peer=placement[producer])
            elif a.kind in (Kind.SEND_F, Kind.SEND_B):
                neighbour = (nxt if a.kind is Kind.SEND_F else prev).get(a.stage)
                if neighbour is None:
                    raise ValueError(f"{path.name} rank {r}: {to_torch_str(a)} sends past the end of its pipeline")
                a = Action(a.kind, a.stage, a.mb, peer=placement[neighbour])
            converted.append(a)
        actions.append(tuple(converted))
    return schedule.with_actions(tuple(actions))


def _template_microbatches(kind: str, ranks: int, per_pipeline: int) -> int:
    from schedules.registry import kind_of

    return per_pipeline * kind_of(kind).csv_rounds
