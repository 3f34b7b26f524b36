"""Closed-form bubble and peak-activation numbers of schedules.md §7, for checks and for the CLI's report."""
from __future__ import annotations

from schedules.durations import Durations
from schedules.ir import Schedule


def bubble_formula(schedule: Schedule, d: Durations) -> tuple[str, float] | None:
    """(formula text, value) of the idle time per rank the literature gives for this schedule kind.

    Exact for uniform stages and zero communication; DualPipe(V) is exact for F = I = W and F&B = F + B only.
    Returns None for kinds without a published formula.
    """
    P = schedule.num_ranks
    F, I, W = d.F, d.I, d.W
    B = d.B if d.B is not None else I + W
    FB = d.FB if d.FB is not None else F + B
    if schedule.kind in ("1f1b", "gpipe"):
        return "(P-1)(F+B)", (P - 1) * (F + B)
    if schedule.kind == "zb1p":
        return "(P-1)(F+B-2W)", (P - 1) * (F + B - 2 * W)
    if schedule.kind in ("dualpipe", "dualpipev"):
        PP = P if schedule.kind == "dualpipe" else 2 * P
        return "(PP/2-1)(F&B+B-3W)", (PP / 2 - 1) * (FB + B - 3 * W)
    return None


def peak_activation_bound(schedule: Schedule) -> int | None:
    """Published peak live chunk activations per rank: 1F1B/ZB1P P; DualPipe P+1; DualPipeV 2P+1 half-stage
    chunks (= P + 1/2 stages' worth); GPipe M."""
    P = schedule.num_ranks
    return {"1f1b": P, "zb1p": P, "gpipe": schedule.num_microbatches, "dualpipe": P + 1,
            "dualpipev": 2 * P + 1}.get(schedule.kind)
