"""Shared helpers for the traces tests: a small 1F1B pipeline simulator (independent of `schedules/`, so these
tests pin the trace code alone) and the location of the shared third-party trace files. Imported by name (not a
conftest.py, so other test folders can keep their own conftest without a module-name clash)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from traces.trace import Span, Trace

SHARED_TRACES = Path(__file__).resolve().parents[2].parent / "shared/data/traces"


def one_f_one_b(ranks: int, microbatches: int, f: Callable[[int, int], float] | float = 10.0,
                b: Callable[[int, int], float] | float = 20.0, comm: float = 1.0, source: str = "simulated",
                kind: str = "1f1b", origin: float = 0.0, steps: int = 1, step_gap: float = 50.0) -> Trace:
    """A 1F1B pipeline timeline: rank r runs stage r; F(r, m) waits for F(r-1, m) plus a transfer, B(r, m) for
    B(r+1, m) plus a transfer; SEND/RECV spans on the comm stream. `steps` repeats the step (measured runs)."""
    fd = f if callable(f) else (lambda r, m, v=f: v)
    bd = b if callable(b) else (lambda r, m, v=b: v)
    spans: list[Span] = []
    t_step = origin
    for _ in range(steps):
        orders = []
        for r in range(ranks):
            warm = min(ranks - r - 1, microbatches)
            order = [("F", m) for m in range(warm)]
            nf, nb = warm, 0
            while nb < microbatches:
                if nf < microbatches:
                    order.append(("F", nf))
                    nf += 1
                order.append(("B", nb))
                nb += 1
            orders.append(order)
        done: dict[tuple[str, int, int], float] = {}
        free = [t_step] * ranks
        ptr = [0] * ranks
        while any(ptr[r] < len(orders[r]) for r in range(ranks)):
            progressed = False
            for r in range(ranks):
                if ptr[r] >= len(orders[r]):
                    continue
                op, m = orders[r][ptr[r]]
                if op == "F":
                    dep = [] if r == 0 else [("F", r - 1, m)]
                else:
                    dep = [("F", r, m)] + ([] if r == ranks - 1 else [("B", r + 1, m)])
                if any(d not in done for d in dep):
                    continue
                ready = max([free[r]] + [done[d] + (comm if d[1] != r else 0.0) for d in dep])
                dur = fd(r, m) if op == "F" else bd(r, m)
                spans.append(Span(r, "compute", op, r, m, ready, dur))
                done[(op, r, m)] = ready + dur
                free[r] = ready + dur
                ptr[r] += 1
                progressed = True
                nxt = r + 1 if op == "F" else r - 1
                if 0 <= nxt < ranks and comm > 0:
                    spans.append(Span(r, "comm", f"SEND_{op}", r, m, ready + dur, comm, peer=nxt))
                    spans.append(Span(nxt, "comm", f"RECV_{op}", r, m, ready + dur, comm, peer=r))
            assert progressed, "deadlock in the test simulator"
        t_step = max(s.end for s in spans) + step_gap
    meta = {"source": source, "time_unit": "us",
            "schedule": {"kind": kind, "ranks": ranks, "microbatches": microbatches}}
    if source == "measured":
        meta = {"source": "measured", "time_unit": "us"}
    return Trace(spans=spans, meta=meta)


@pytest.fixture
def shared_traces() -> Path:
    if not SHARED_TRACES.is_dir():
        pytest.skip(f"shared trace folder {SHARED_TRACES} is absent")
    return SHARED_TRACES
