"""The overlapped F&B stage as the simulated step runs it: what DeepSeek's 6.7% is a share of (costmodel.md §5).

In DualPipe's steady state every rank runs F&B pairs (the forward of one chunk overlapped with the backward of
another). The stage's time is the pairs' time *in the step*: each pair as often as the schedule runs it, each one
as long as the simulation ran it, including the time a half waited for its input (a pair starts when either
half's input is there, schedules/engine.py). A median over pair kinds priced alone, with their inputs on time,
weights a pair that runs twice per step like one that runs forty times and misses every late input.

* `fb_stage_us(sim)`: the mean over the ranks that run pairs of their summed F&B span time, or None without pairs
  (GPipe, 1F1B, ZB1P).
* `pair_table(...)`: one row per pair kind (forward stage, backward stage): how often it runs per step, its time
  priced alone (inputs on time) and its mean time as run, baseline and mHC, so a reader sees which pairs carry the
  overhead and how much the late inputs change it.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from schedules.simulate import SimResult


def _pair_spans(sim: SimResult):
    return [s for s in sim.trace.spans if s.kind == "FB" and s.stream == "compute"]


def fb_stage_us(sim: SimResult) -> float | None:
    """Mean over the ranks that run F&B pairs of their summed pair time in the simulated step (us)."""
    per: dict[int, float] = {}
    for s in _pair_spans(sim):
        per[s.rank] = per.get(s.rank, 0.0) + s.duration
    return statistics.fmean(per.values()) if per else None


def overhead_pct(mhc_us: float | None, base_us: float | None) -> float | None:
    return None if not mhc_us or not base_us else 100.0 * (mhc_us / base_us - 1.0)


@dataclass
class PairRow:
    """One F&B pair kind: forward stage f, backward stage b."""

    f_stage: int
    b_stage: int
    count: int  # pairs of this kind per step, over all ranks of one pipeline
    alone_us: dict[str, float]  # priced alone, inputs on time: baseline, mhc
    as_run_us: dict[str, float]  # mean duration in the simulated step: baseline, mhc

    @property
    def alone_pct(self) -> float | None:
        return overhead_pct(self.alone_us["mhc"], self.alone_us["baseline"])

    @property
    def as_run_pct(self) -> float | None:
        return overhead_pct(self.as_run_us["mhc"], self.as_run_us["baseline"])

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"alone_pct": self.alone_pct, "as_run_pct": self.as_run_pct}


def pair_table(sims: dict[str, SimResult], alone: dict[str, dict[tuple[int, int], float]]) -> list[PairRow]:
    """Rows per pair kind from the baseline and mHC simulations (`sims`: baseline, mhc) and the pairs' prices
    alone (`alone[name][(f, b)]` in us), ordered by stage pair."""
    runs: dict[str, dict[tuple[int, int], list[float]]] = {}
    for name, sim in sims.items():
        for s in _pair_spans(sim):
            runs.setdefault(name, {}).setdefault((s.stage, s.partner[0]), []).append(s.duration)
    kinds = sorted(runs.get("mhc", {}))
    rows = []
    for k in kinds:
        base, mhc = runs.get("baseline", {}).get(k, []), runs["mhc"][k]
        rows.append(PairRow(k[0], k[1], len(mhc),
                            {n: alone.get(n, {}).get(k, float("nan")) for n in ("baseline", "mhc")},
                            {"baseline": statistics.fmean(base) if base else float("nan"),
                             "mhc": statistics.fmean(mhc)}))
    return rows
