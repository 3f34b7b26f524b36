"""Waiting for messages: per rank and step, the time its compute waits for incoming stage-boundary messages
(RECV_F, RECV_B). It is the exposed P2P communication that a prediction and a measurement can both state, so
traces.analysis.compare compares it per rank; the SEND/RECV spans themselves mean different things on the two sides
(`comm_span_meaning`).

* A trace that records WAIT spans (the runtime's, meta `wait_spans`): the WAIT spans of a receive, i.e. the
  time the compute thread blocked on it, from the wait's start to the message's completion.
* Any other trace (predictions, imported runs): read off the timeline. On each rank, a stretch in which it
  computes nothing before a compute action - from the step's start or from its previous compute's end - counts
  up to the last receive that completes inside it. That is the same wait: a simulated rank idles only until a
  message it needs arrives, and a receive's span ends at its arrival (a transfer) or its completion. Computed
  for every step at once by traces.analysis.time_stats.
Both are summed over a rank's steps and divided by the number of steps.
"""
from __future__ import annotations

import numpy as np

from traces.columns import columns_of
from traces.names import WAIT_KIND
from traces.trace import Trace

RECEIVE_KINDS = ("RECV_F", "RECV_B")
TRANSFER = "transfer"  # a SEND/RECV span is the message on the wire: both sides posted -> arrival
POST_TO_COMPLETION = "post to completion"  # a SEND/RECV span runs from the op's post to its completion


def comm_span_meaning(trace: Trace) -> str:
    """What a SEND/RECV span of `trace` covers: a prediction's (schedules.simulate, costmodel.local.shared_cores)
    is the transfer; a measured run's is the op from its post to its completion (traces.md §5)."""
    return TRANSFER if trace.meta.get("source") in ("predicted", "simulated") else POST_TO_COMPLETION


def receive_wait(trace: Trace, ranks: list[int], waits: list[dict[int, float] | None]) -> dict[int, float]:
    """Per rank, the mean time per step its compute waited for incoming messages (see the module docstring).
    `ranks`: those of the counted steps' schedule spans; `waits`: each counted step's waits read off the timeline
    (time_stats; None where the trace records its waits as WAIT spans, which are read instead)."""
    if not waits:
        return {}
    total: dict[int, float] = dict.fromkeys(ranks, 0.0)
    if trace.meta.get("wait_spans"):
        cols = columns_of(trace)  # the WAIT spans by their kind's code: 10^6 spans, 10^5 waits
        code = cols.kinds.index(WAIT_KIND) if WAIT_KIND in cols.kinds else -1
        waits_at = np.flatnonzero(cols.kind == code)
        labels = trace.labels(waits_at.tolist())
        receive: dict[str, bool] = {}  # label -> a wait for a receive? (a few hundred distinct labels)
        for label in set(labels):
            target = label[5:] if label.startswith("WAIT/") else ""
            receive[label] = target.split("/", 1)[0] in RECEIVE_KINDS
        mine = waits_at[[receive[label] for label in labels]] if len(waits_at) else waits_at
        for r in dict.fromkeys(cols.rank[mine].tolist()):  # ranks without schedule spans after the others
            total.setdefault(r, 0.0)
        order = list(total)
        sums = np.zeros(len(order))
        at = {r: j for j, r in enumerate(order)}
        # added one after another in file order, per rank: the floats the loop over the spans gave
        np.add.at(sums, np.array([at[r] for r in cols.rank[mine].tolist()], dtype=np.int64), cols.duration[mine])
        total = dict(zip(order, sums.tolist()))
    else:
        for step in waits:
            for r, v in step.items():
                total[r] = total.get(r, 0.0) + v
    return {r: v / len(waits) for r, v in total.items()}

