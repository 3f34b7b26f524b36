"""traces.columns: a trace's spans as numpy columns, the spans' own values (read back from a file too), and rebuilt
when the span list changes."""
from __future__ import annotations

import numpy as np

from traces.columns import columns_of
from traces.trace import Span, Trace


def _trace() -> Trace:
    spans = [Span(r, st, k, 0, m, 10.0 * m + r + 0.1, 3.3 + m, peer=1 - r if st == "comm" else None)
             for r in (0, 1) for m in range(5)
             for st, k in (("compute", "F"), ("comm", "SEND_F"), ("hp", "F.post_res"))]
    return Trace(spans=spans, meta={"source": "measured"})


def _same(a, b) -> None:
    for f in ("rank", "start", "duration", "end"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    assert [a.kinds[k] for k in a.kind] == [b.kinds[k] for k in b.kind]
    assert [a.streams[k] for k in a.stream] == [b.streams[k] for k in b.stream]


def test_the_columns_are_the_spans_values(tmp_path):
    t = _trace()
    built = columns_of(t)
    assert [built.kinds[k] for k in built.kind] == [s.kind for s in t.spans]
    assert built.end.tolist() == [s.end for s in t.spans]  # the same float as Span.end
    loaded = Trace.load(t.save(tmp_path / "t.json"))
    _same(columns_of(loaded), built)


def test_rebuilt_when_the_spans_change(tmp_path):
    t = Trace.load(_trace().save(tmp_path / "t.json"))
    first = columns_of(t)
    assert columns_of(t) is first
    t.spans.append(Span(1, "compute", "W", 0, 9, 99.0, 1.0))
    again = columns_of(t)
    assert len(again) == len(first) + 1 and again.kinds[again.kind[-1]] == "W"
    t.spans = t.spans[:3]
    assert len(columns_of(t)) == 3


def test_bincount_adds_in_input_order_as_a_loop_does():
    """What overlap_stats and compare rely on to keep their sums byte-identical to the per-span loops: bincount
    with weights adds each bin's values one by one in input order (np.sum, pairwise, does not: the control)."""
    import random

    rng = random.Random(1)
    w = [rng.uniform(-1, 1) * 10 ** rng.randint(-8, 8) for _ in range(100_000)]
    codes = np.asarray([rng.randint(0, 2) for _ in w])
    loop = [0.0, 0.0, 0.0]
    for c, x in zip(codes.tolist(), w):
        loop[c] += x
    assert np.bincount(codes, weights=np.asarray(w), minlength=3).tolist() == loop
    assert float(np.sum(np.asarray(w)[codes == 0])) != loop[0]  # the control: another order, another float
