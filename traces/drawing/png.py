"""The project's one PNG writer (matplotlib, Agg): the pictures of traces, diagnostics and the cost model."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def save_png(fig, out: str | Path) -> Path:
    """Write `fig` (tight layout, 120 dpi) and close it; the path with the .png matplotlib adds when none is given."""
    out = Path(out)
    if not out.suffix:  # matplotlib would add it; say where the file really is
        out = out.with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
