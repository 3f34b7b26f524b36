"""The mHC overhead chart of a comparison with a baseline pair (`mhcpipe compare --plot`, the demo's overhead.png):
per cause, percentage points of the baseline step, predicted beside measured."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from traces.analysis.compare import Comparison
from traces.drawing.png import plt
from traces.trace import TraceError


def plot_overhead(comp: Comparison, path: str | Path) -> Path:
    """Bar chart of the mHC overhead breakdown (pp of the baseline step), predicted vs measured."""
    path = Path(path)
    if comp.overhead is None:
        raise TraceError("the overhead chart needs a baseline pair (--baseline-pred and --baseline-meas)")
    o = comp.overhead
    keys = list(dict.fromkeys(list(o.breakdown_pred_pp) + list(o.breakdown_meas_pp))) + ["total"]
    pv = [o.breakdown_pred_pp.get(k, 0.0) for k in keys[:-1]] + [o.pred_pct]
    mv = [o.breakdown_meas_pp.get(k, 0.0) for k in keys[:-1]] + [o.meas_pct]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(keys) + 2), 4.2))
    x = np.arange(len(keys))
    ax.bar(x - 0.2, pv, 0.4, label="predicted", color="#5b8ec9", edgecolor="black", linewidth=0.4)
    ax.bar(x + 0.2, mv, 0.4, label="measured", color="#f4a259", edgecolor="black", linewidth=0.4)
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xticks(x)
    ax.set_xticklabels(keys, fontsize=8)
    ax.set_ylabel("percentage points of the baseline step")
    ax.set_title(f"mHC overhead: predicted {o.pred_pct:.2f}% vs measured {o.meas_pct:.2f}% "
                 f"({o.diff_pp:+.2f} pp)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
