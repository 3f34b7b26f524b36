"""Range names of traces.md §5: parse a name into (op kind, stage, micro-batch, ...) and format it back.

    name   := OP "/s" STAGE "/mb" MB [ "+s" STAGE "/mb" MB ] [ "/L" LAYER "." KERNEL ] [ "~" STREAM ]
    OP     := F | I | B | W | FB | SEND_F | RECV_F | SEND_B | RECV_B | RC | RG | OPT
    STREAM := hp | comm                     (absent = the normal compute stream)

Examples: `F/s3/mb7`, `FB/s3/mb7+s4/mb2` (forward half first), `SEND_F/s3/mb7~comm`,
`F/s3/mb7/L12.post_res~hp`. One outer range `step/K` per iteration (Kineto's `ProfilerStep#K` is read the
same way). PyTorch pipelining action strings (`3F7`, `(3F7;4B2)OVERLAP_F_B`, optionally prefixed `PP:`) are
accepted too. Report tools prefix names with an NVTX domain (`mhc_pipe:F/s3/mb7`, or `:F/s3/mb7` for the
default domain); that prefix is stripped, since our names never contain `:`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from traces.trace import Span, span_name

OPS = ("F", "I", "B", "W", "FB", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "RC", "RG", "OPT")
SCHEDULE_KINDS = frozenset(OPS)
COMM_KINDS = frozenset({"SEND_F", "RECV_F", "SEND_B", "RECV_B"})
LOGICAL_STREAMS = ("compute", "hp", "comm")
STEP_KIND = "step"
RANGE_KIND = "range"  # a range whose name does not follow the convention: kept, reported, never matched

_OPS_RE = "|".join(sorted(OPS, key=len, reverse=True))
_NAME_RE = re.compile(
    rf"^(?P<op>{_OPS_RE})/s(?P<stage>\d+)/mb(?P<mb>\d+)"
    r"(?:\+s(?P<pstage>\d+)/mb(?P<pmb>\d+))?"
    r"(?:/L(?P<layer>\d+)\.(?P<kernel>[A-Za-z_][A-Za-z0-9_]*))?"
    r"(?:~(?P<stream>hp|comm))?$")
_PT_ACTION_RE = re.compile(rf"^(?P<stage>\d+)(?P<op>{_OPS_RE})(?P<mb>\d+)$")
_PT_OVERLAP_RE = re.compile(r"^\((?P<a>\d+F\d+);(?P<b>\d+B\d+)\)OVERLAP_F_B$")
_STEP_RE = re.compile(r"^(?:step/|ProfilerStep#)(?P<k>\d+)$")


@dataclass(frozen=True, slots=True)
class RangeName:
    """What a range name says. `kind` is the op kind; for a per-kernel part (`/L12.post_res`) it is
    `F.post_res`, so per-kind error statistics separate each mHC kernel from the whole op."""

    kind: str
    stage: int | None = None
    mb: int | None = None
    partner: tuple[int, int] | None = None
    layer: int | None = None
    kernel: str | None = None
    stream: str = "compute"
    step: int | None = None

    @property
    def op(self) -> str:
        return self.kind.split(".", 1)[0]

    @property
    def part(self) -> str | None:
        return None if self.kernel is None else f"L{self.layer}.{self.kernel}"


def strip_domain(name: str) -> str:
    """`mhc_pipe:F/s3/mb7` -> `F/s3/mb7`; `:F/s3/mb7` -> `F/s3/mb7` (nsys report domain prefixes)."""
    return name.rsplit(":", 1)[1] if ":" in name else name


def parse_name(name: str) -> RangeName | None:
    """The parsed name, or None when `name` does not follow the convention (a foreign range)."""
    text = name.strip()
    m = _NAME_RE.match(text) or (_NAME_RE.match(strip_domain(text)) if ":" in text else None)
    if m is not None:
        partner = None
        if m["pstage"] is not None:
            if m["op"] != "FB":
                return None  # only the overlapped pair names a second (stage, mb)
            partner = (int(m["pstage"]), int(m["pmb"]))
        elif m["op"] == "FB":
            return None  # FB without its backward half is malformed
        kind = m["op"] if m["kernel"] is None else f"{m['op']}.{m['kernel']}"
        return RangeName(kind=kind, stage=int(m["stage"]), mb=int(m["mb"]), partner=partner,
                         layer=None if m["layer"] is None else int(m["layer"]), kernel=m["kernel"],
                         stream=m["stream"] or "compute")
    s = _STEP_RE.match(text)
    if s is not None:
        return RangeName(kind=STEP_KIND, step=int(s["k"]), stream=STEP_KIND)
    pt = text[3:] if text.startswith("PP:") else text
    a = _PT_ACTION_RE.match(pt)
    if a is not None:
        stream = "comm" if a["op"] in COMM_KINDS else "compute"
        return RangeName(kind=a["op"], stage=int(a["stage"]), mb=int(a["mb"]), stream=stream)
    o = _PT_OVERLAP_RE.match(pt)
    if o is not None:
        f, b = _PT_ACTION_RE.match(o["a"]), _PT_ACTION_RE.match(o["b"])
        return RangeName(kind="FB", stage=int(f["stage"]), mb=int(f["mb"]), partner=(int(b["stage"]), int(b["mb"])))
    return None


def format_name(parsed: RangeName) -> str:
    """Inverse of `parse_name` for convention names (round-trips every name `parse_name` accepts
    in the canonical `OP/sS/mbM...` form)."""
    if parsed.kind == STEP_KIND:
        return f"step/{parsed.step}"
    name = span_name(parsed.op, parsed.stage, parsed.mb, parsed.partner)
    if parsed.kernel is not None:
        name += f"/L{parsed.layer}.{parsed.kernel}"
    if parsed.stream != "compute":
        name += f"~{parsed.stream}"
    return name


def part_of(label: str) -> str | None:
    """The `L12.post_res` part of a span label, if any (part of the compare key)."""
    parsed = parse_name(label)
    return None if parsed is None else parsed.part


def is_schedule_span(kind: str, stage: int | None) -> bool:
    """Spans that take part in matching: a schedule op (or an mHC kernel part of one) with a stage."""
    return stage is not None and kind.split(".", 1)[0] in SCHEDULE_KINDS


def range_span(rank: int, stream: str, parsed: RangeName | None, text: str, start: float, duration: float) -> Span:
    """The span of one measured range: convention names give kind/stage/mb/partner; foreign names are kept
    as kind "range" with their text. `name` stays empty when the label rebuilds the text exactly."""
    if parsed is None:
        return Span(rank, stream, RANGE_KIND, None, None, start, duration, name=text)
    name = "" if span_name(parsed.kind, parsed.stage, parsed.mb, parsed.partner, stream) == text else text
    return Span(rank, stream, parsed.kind, parsed.stage, parsed.mb, start, duration, partner=parsed.partner,
                name=name)
