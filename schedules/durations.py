"""Per-action durations for the simulator: per op kind, optionally per stage, plus P2P alpha-beta costs."""
from __future__ import annotations

import pydantic

from schedules.ir import Action, Kind

_KINDS = ("F", "I", "W", "B", "FB")


class Durations(pydantic.BaseModel):
    """Durations in microseconds (any unit works if used consistently; unit costs use 1).

    B defaults to I + W and FB (the overlapped forward/backward step) to F + B, as the DualPipe figures draw
    it. Per-stage values override the global ones for that stage.
    """

    model_config = pydantic.ConfigDict(extra="forbid")
    F: float = pydantic.Field(1.0, ge=0, description="forward of one chunk")
    I: float = pydantic.Field(1.0, ge=0, description="input-grad backward of one chunk")  # noqa: E741
    W: float = pydantic.Field(1.0, ge=0, description="weight-grad backward of one chunk")
    B: float | None = pydantic.Field(None, ge=0, description="full backward; default I + W")
    FB: float | None = pydantic.Field(None, ge=0, description="overlapped F&B step; default F + B of its halves")
    per_stage: dict[int, dict[str, float]] = pydantic.Field(
        default_factory=dict, description="stage -> {kind: duration} overrides")
    p2p_latency: float = pydantic.Field(0.0, ge=0, description="alpha: fixed cost of one P2P message")
    p2p_bandwidth: float | None = pydantic.Field(
        None, gt=0, description="beta^-1 in bytes per time unit (bytes/us = MB/s); None = infinitely fast")
    message_bytes: float = pydantic.Field(0.0, ge=0, description="bytes of one stage-boundary message")

    @pydantic.field_validator("per_stage")
    @classmethod
    def _known_kinds(cls, value: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
        for stage, costs in value.items():
            for kind, d in costs.items():
                if kind not in _KINDS:
                    raise ValueError(f"per_stage[{stage}]: unknown kind {kind!r}; use one of {', '.join(_KINDS)}")
                if d < 0:
                    raise ValueError(f"per_stage[{stage}][{kind}]: duration must be >= 0, got {d}")
        return value

    def _of(self, kind: str, stage: int) -> float:
        override = self.per_stage.get(stage)
        if override and kind in override:
            return override[kind]
        if kind == "B":
            return self.B if self.B is not None else self._of("I", stage) + self._of("W", stage)
        return getattr(self, kind)

    def compute(self, a: Action) -> float:
        if a.kind is Kind.FB:
            if self.FB is not None:
                return self.FB
            return self._of("F", a.stage) + self._of("B", a.b_stage)
        return self._of(a.kind.value, a.stage)

    def transfer(self, a: Action) -> float:
        if self.p2p_bandwidth is None:
            return self.p2p_latency
        return self.p2p_latency + self.message_bytes / self.p2p_bandwidth

    @classmethod
    def parse(cls, text: str) -> "Durations":
        """`F=1,B=2,W=1` (CLI form). Given B and W but not I, I = B - W; given I and W, B defaults to I + W."""
        values: dict[str, float] = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep or key not in _KINDS:
                raise ValueError(f"--cost: cannot read {item!r}; write KIND=NUMBER with KIND in "
                                 f"{', '.join(_KINDS)}, e.g. F=1,B=2,W=1")
            try:
                values[key] = float(raw)
            except ValueError:
                raise ValueError(f"--cost: {key}={raw!r} is not a number") from None
            if values[key] < 0:
                raise ValueError(f"--cost: {key} must be >= 0, got {values[key]}")
        if "B" in values and "I" not in values:
            w = values.get("W", 1.0)
            if values["B"] < w:
                raise ValueError(f"--cost: B={values['B']} is smaller than W={w}; B = I + W needs B >= W")
            values["I"] = values["B"] - w
        return cls(**values)
