"""Range names of traces.md §5: parse a name into (op kind, stage, micro-batch, ...) and format it back.

    name   := OP "/s" STAGE "/mb" MB [ "+s" STAGE "/mb" MB ] [ "/L" LAYER [ "." KERNEL ] ] [ "~" STREAM ]
            | "WAIT/" name                  (the compute thread blocked on that communication op)
    OP     := F | I | B | W | FB | SEND_F | RECV_F | SEND_B | RECV_B | A2A_DISPATCH | A2A_COMBINE | RC | RG | OPT
    STREAM := hp | comm                     (absent = the normal compute stream)

Examples: `F/s3/mb7`, `FB/s3/mb7+s4/mb2` (forward half first), `SEND_F/s3/mb7~comm`,
`F/s3/mb7/L12.post_res~hp`. Expert-parallel all-to-all: `A2A_DISPATCH/s3/mb7/L13~comm` (the rows out),
`A2A_DISPATCH/s3/mb7/L13.counts~comm` (the per-expert counts before them), `A2A_COMBINE/s3/mb7/L13~comm` (the
outputs back), and in the backward `A2A_COMBINE/s3/mb7/L13.dgrad~comm`, `A2A_DISPATCH/s3/mb7/L13.dgrad~comm`.
Inside an overlapped F&B pair each stretch of a half's compute is named after where it starts:
`F/s3/mb7/L12.block`, `F/s3/mb7/L13.experts`, `B/s4/mb2/L13.router`, and the backward's deferred weight-grads
run in a wait or at the pair's end, one closure each, `B/s4/mb2/L3.wfill`. `WAIT/RECV_F/s2/mb7`
or `WAIT/A2A_COMBINE/s3/mb7/L13`: the time the compute thread blocked on that op (exposed communication); kind
WAIT, with the stage and micro-batch of the op. One outer range `step/K` per iteration (Kineto's
`ProfilerStep#K` is read the same way). PyTorch pipelining action strings (`3F7`, `(3F7;4B2)OVERLAP_F_B`,
optionally prefixed `PP:`) are accepted too. Report tools prefix names with an NVTX domain
(`mhc_pipe:F/s3/mb7`, or `:F/s3/mb7` for the default domain); that prefix is stripped, since our names never
contain `:`.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from traces.trace import Span, span_name

A2A_KINDS = ("A2A_DISPATCH", "A2A_COMBINE")
WAIT_KIND = "WAIT"
OPS = ("F", "I", "B", "W", "FB", "SEND_F", "RECV_F", "SEND_B", "RECV_B", *A2A_KINDS, "RC", "RG", "OPT")
# the ops a prediction and a measurement are matched on (all-to-alls and waits are measured, not yet predicted)
SCHEDULE_KINDS = frozenset(OPS) - frozenset(A2A_KINDS)
COMM_KINDS = frozenset({"SEND_F", "RECV_F", "SEND_B", "RECV_B"})
ALL_COMM_KINDS = COMM_KINDS | frozenset(A2A_KINDS) | {"RG"}  # every communication op (by base kind)
LOGICAL_STREAMS = ("compute", "hp", "comm")
STEP_KIND = "step"
RANGE_KIND = "range"  # a range whose name does not follow the convention: kept, reported, never matched
P2P_NODE = "P2P"  # a step graph's node of one stage-boundary transfer (traces.analysis.span_nodes)
COMM_NODE_KINDS = frozenset({P2P_NODE, *A2A_KINDS, "RG"})  # the step graph's communication nodes

_OPS_RE = "|".join(sorted(OPS, key=len, reverse=True))
_NAME_RE = re.compile(
    rf"^(?P<op>{_OPS_RE})/s(?P<stage>\d+)/mb(?P<mb>\d+)"
    r"(?:\+s(?P<pstage>\d+)/mb(?P<pmb>\d+))?"
    r"(?:/L(?P<layer>\d+)(?:\.(?P<kernel>[A-Za-z_][A-Za-z0-9_]*))?)?"
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
    waits_for: "RangeName | None" = None  # kind WAIT: the communication op the compute thread blocked on

    @property
    def op(self) -> str:
        return self.kind.split(".", 1)[0]

    @property
    def part(self) -> str | None:
        if self.layer is None:
            return None
        return f"L{self.layer}" + ("" if self.kernel is None else f".{self.kernel}")


def strip_domain(name: str) -> str:
    """`mhc_pipe:F/s3/mb7` -> `F/s3/mb7`; `:F/s3/mb7` -> `F/s3/mb7` (nsys report domain prefixes)."""
    return name.rsplit(":", 1)[1] if ":" in name else name


@functools.lru_cache(maxsize=1 << 16)  # a run repeats its names every step (F/s3/mb7 once a step): parsed once
def parse_name(name: str) -> RangeName | None:
    """The parsed name (frozen, shared by every caller), or None when `name` does not follow the convention (a
    foreign range)."""
    text = name.strip()
    if ":" in text:
        text = strip_domain(text)
    if text.startswith("WAIT/"):
        inner = parse_name(text[5:])
        if inner is None or inner.stage is None or inner.stream != "compute":
            return None
        return RangeName(kind=WAIT_KIND, stage=inner.stage, mb=inner.mb, waits_for=inner)
    m = _NAME_RE.match(text)
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
    if parsed.kind == WAIT_KIND and parsed.waits_for is not None:
        return f"WAIT/{format_name(parsed.waits_for)}"
    return span_name(parsed.op, parsed.stage, parsed.mb, parsed.partner, parsed.stream, parsed.part)


def kernel_part(label: str) -> str | None:
    """The part a span of a dotted kind (`F.post_res`) names, as the compare key holds it
    (traces.analysis.matching.span_key): its label's `L12.post_res`, or the label itself when it follows no
    convention."""
    parsed = parse_name(label)
    return parsed.part if parsed is not None else label


def is_schedule_span(kind: str, stage: int | None) -> bool:
    """Spans that take part in matching: a schedule op (or an mHC kernel part of one) with a stage."""
    return stage is not None and _schedule_kind(kind)


@functools.lru_cache(maxsize=1 << 12)
def _schedule_kind(kind: str) -> bool:
    """Whether `kind` is a schedule op's or a part of one: a trace has a few dozen kinds, asked per span per step."""
    return kind.split(".", 1)[0] in SCHEDULE_KINDS


def range_span(rank: int, stream: str, parsed: RangeName | None, text: str, start: float, duration: float) -> Span:
    """The span of one measured range: convention names give kind/stage/mb/partner; foreign names are kept
    as kind "range" with their text. `name` stays empty when the label rebuilds the text exactly."""
    if parsed is None:
        return Span(rank, stream, RANGE_KIND, None, None, start, duration, name=text)
    name = "" if span_name(parsed.kind, parsed.stage, parsed.mb, parsed.partner, stream) == text else text
    return Span(rank, stream, parsed.kind, parsed.stage, parsed.mb, start, duration, partner=parsed.partner,
                name=name)
