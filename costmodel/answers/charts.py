"""Pictures for `mhcpipe predict --explain` (waterfall) and `--sensitivity` (tornado), matplotlib with Agg.

Both draw two panels side by side: mHC's overhead of the overlapped F&B stage (like for like with the paper's 6.7%)
and of the whole step.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from costmodel.answers.explain import Explanation
from costmodel.answers.honest import PAPER_PCT
from costmodel.answers.sensitivity import Sensitivity
from traces.drawing.png import save_png

UP, DOWN, TOTAL = "#d62728", "#2ca02c", "#4c72b0"
LOW, HIGH = "#1f77b4", "#ff7f0e"


def waterfall(ex: Explanation, out: str | Path) -> Path:
    """Bars from the naive rung's added time, up or down by each rung's change, to the final one, every rung on one
    denominator (the last rung's baseline: explain.py); each rung labelled."""
    labels = [f"{i} {r.name}" for i, r in enumerate(ex.rungs)]
    panels = [("step", [ex.step_share_pct(r) for r in ex.rungs])]
    if ex.on_fb_stage:
        panels.insert(0, ("overlapped F&B stage (like for like)", [ex.share_pct(r) for r in ex.rungs]))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.0 * len(panels), 4.6), squeeze=False)
    for ax, (title, vals) in zip(axes[0], panels):
        n = len(vals)
        xs = list(range(n + 1))
        ax.bar(0, vals[0], color=TOTAL)
        ax.text(0, vals[0], f"{vals[0]:.1f}", ha="center", va="bottom", fontsize=8)
        for i in range(1, n):
            d = vals[i] - vals[i - 1]
            ax.bar(i, d, bottom=vals[i - 1], color=UP if d > 0 else DOWN)
            ax.text(i, max(vals[i], vals[i - 1]), f"{d:+.1f}", ha="center", va="bottom", fontsize=8)
        ax.bar(n, vals[-1], color=TOTAL)
        ax.text(n, vals[-1], f"{vals[-1]:.1f}", ha="center", va="bottom", fontsize=8)
        if "F&B" in title:
            ax.axhline(PAPER_PCT, color="0.4", lw=0.8, ls="--", zorder=0, label=f"paper {PAPER_PCT}%")
            ax.legend(loc="upper right", fontsize=8)
        lo, hi = min(0.0, *vals), max(0.0, *vals)
        ax.set_ylim(lo - 0.08 * (hi - lo), hi + 0.12 * (hi - lo) + 1e-9)  # room for the labels above the bars
        ax.axhline(0, color="black", lw=0.6)
        ax.set_xticks(xs, labels + ["final"], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("ms mHC adds, % of the last rung's baseline")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{ex.config} on {ex.hardware}: mHC overhead, one mechanism at a time", fontsize=11)
    return save_png(fig, out)


def tornado(se: Sensitivity, out: str | Path) -> Path:
    """Per input, a bar from its low-side to its high-side overhead around the base; widest swing on top."""
    panels = [("overlapped F&B stage", "fb_pct"), ("whole step", "step_pct")]
    panels = [(t, m) for t, m in panels if getattr(se.base, m) is not None]
    rows = list(reversed(se.rows))  # barh draws bottom-up
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 0.5 * len(rows) + 1.8), squeeze=False)
    for ax, (title, metric) in zip(axes[0], panels):
        base = getattr(se.base, metric)
        for y, r in enumerate(rows):
            for side, p in (("low", r.low), ("high", r.high)):
                v = getattr(p, metric) if p is not None else None
                if v is None:
                    continue
                ax.barh(y, v - base, left=base, color=LOW if side == "low" else HIGH)
                # a bar of no width still names its value, low side left of the base line, high side right
                right = v > base or (v == base and side == "high")
                ax.text(v, y, f" {p.label} ", va="center", ha="left" if right else "right", fontsize=7)
        ax.axvline(base, color="black", lw=0.8)
        ax.set_yticks(range(len(rows)), [r.name for r in rows], fontsize=8)
        ax.set_xlabel(f"mHC overhead, % (base {base:.2f}%)")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
        ax.margins(x=0.18)
        ax.legend(handles=[Patch(color=LOW, label="input lower"), Patch(color=HIGH, label="input higher")],
                  fontsize=8, loc="lower right")
    fig.suptitle(f"{se.config} on {se.hardware}: overhead when one input moves -+{se.pct:g}%", fontsize=11)
    return save_png(fig, out)
