"""Project CPU-side ranges onto GPU time (traces.md §2.2, the rule of nsys's `nvtx_gpu_proj_trace`).

A GPU op (kernel, memcpy, memset) belongs to a range when the CUDA runtime call that launched it lies inside the
range on the same thread; the projected interval runs from the first enclosed GPU op's start to the last one's
end. Nested ranges each get every GPU op under them. Shared by the Nsight Systems and Kineto readers.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Hashable

import numpy as np

from traces.trace import union_length


@dataclass(frozen=True, slots=True)
class Projection:
    start: float
    end: float
    num_ops: int
    busy: float  # union length of the enclosed GPU op intervals (gaps excluded)


class Launches:
    """CUDA runtime calls per host thread, each with the interval of the GPU ops it launched (or none)."""

    def __init__(self) -> None:
        self._rows: dict[Hashable, list[tuple[float, float, float, float, int]]] = defaultdict(list)
        self._ops: dict[Hashable, list[list[tuple[float, float]]]] = defaultdict(list)
        self._arrays: dict[Hashable, tuple[np.ndarray, ...]] = {}

    def add(self, thread: Hashable, start: float, end: float, gpu_ops: list[tuple[float, float]]) -> None:
        if gpu_ops:
            g0 = min(a for a, _ in gpu_ops)
            g1 = max(b for _, b in gpu_ops)
        else:
            g0 = g1 = float("nan")
        self._rows[thread].append((start, end, g0, g1, len(gpu_ops)))
        self._ops[thread].append(gpu_ops)
        self._arrays.pop(thread, None)

    def _array(self, thread: Hashable) -> tuple[np.ndarray, ...]:
        arr = self._arrays.get(thread)
        if arr is None:
            rows = self._rows.get(thread, [])
            a = np.asarray(rows, dtype=float).reshape(-1, 5)
            order = np.argsort(a[:, 0], kind="stable")
            a = a[order]
            self._ops[thread] = [self._ops[thread][i] for i in order]
            self._rows[thread] = [rows[i] for i in order]
            arr = (a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4], order)
            self._arrays[thread] = arr
        return arr

    def project(self, thread: Hashable, start: float, end: float) -> Projection | None:
        """GPU interval of the ops launched on `thread` inside [start, end]; None if it launched none."""
        if thread not in self._rows:
            return None
        starts, ends, g0, g1, n, _ = self._array(thread)
        i0 = int(np.searchsorted(starts, start, side="left"))
        i1 = int(np.searchsorted(starts, end, side="right"))
        if i1 <= i0:
            return None
        sel = slice(i0, i1)
        mask = (ends[sel] <= end) & (n[sel] > 0)
        if not mask.any():
            return None
        idx = np.nonzero(mask)[0] + i0
        ops = [iv for i in idx for iv in self._ops[thread][i]]
        return Projection(start=float(g0[idx].min()), end=float(g1[idx].max()), num_ops=int(n[idx].sum()),
                          busy=union_length(ops))
