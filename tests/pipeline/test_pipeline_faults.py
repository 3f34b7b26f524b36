"""Failures end the run quickly and clearly: a rank that dies mid-step, a rank that hangs mid-step."""
from __future__ import annotations

import os
import re
import time

import pytest

from _pipeline_helpers import tiny_config
from pipeline.launch.local import variants_worker
from rank_pool import launch

TIMEOUT_S = 4.0


class StopAt:
    """on_action hook: on rank `victim`, at action `index` of the first step, die (os._exit) or hang."""

    def __init__(self, victim: int, index: int, mode: str):
        self.victim, self.index, self.mode, self.seen = victim, index, mode, 0

    def __call__(self, i, action) -> None:
        if int(os.environ["RANK"]) != self.victim or i != self.index:
            return
        if self.mode == "die":
            os._exit(1)
        time.sleep(120)


CASES = [("dualpipev", "die", "pp4"), ("1f1b", "hang", "pp4"),
         ("dualpipev", "die", "ep"), ("dualpipev", "hang", "ep")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind,mode,layout", CASES, ids=[f"{k}-{m}-{lay}" for k, m, lay in CASES])
def test_failed_rank_stops_the_others(kind, mode, layout):
    """pp4: rank 1 of a 4-rank pipeline. ep: pp=2 x dp=2 with EP=2, rank 1 is rank 0's expert-parallel peer (and
    rank 3's pipeline neighbour): the all-to-alls of rank 0 and the P2P of rank 3 lose their peer."""
    if layout == "pp4":
        cfg = tiny_config(kind, 4, timeout_s=TIMEOUT_S, steps=1)
    else:
        cfg = tiny_config(kind, 2, moe=True, dp=2, ep=2, timeout_s=TIMEOUT_S, steps=1)
    started = time.monotonic()
    results = launch(variants_worker, 4, ([cfg], False, StopAt(1, 6, mode)), timeout_s=60,
                     grace_s=3 * TIMEOUT_S + 5, hung=frozenset({1} if mode == "hang" else ()))
    wall = time.monotonic() - started
    others = [r for r in results if r.rank != 1]
    for r in others:
        assert r.exitcode == 1, f"rank {r.rank} exit code {r.exitcode} (None = still running at the deadline)"
        assert r.error and r.error.startswith(f"rank {r.rank}: "), r.error
        # the op, and the peer: "from rank 2", "to rank 0", or the group "in the EP group (ranks 0, 1)"
        assert re.search(r"(SEND|RECV)_[FB]/s\d+/mb\d+|A2A_(DISPATCH|COMBINE)/s\d+/mb\d+/L\d+|RG/s\d+|all-reduce|"
                         r"barrier", r.error), r.error
        assert re.search(r"(from|to) rank \d|group \(ranks [\d, ]+\)|all-reduce|barrier", r.error), r.error
        assert "timed out after" in r.error or "closed its connection" in r.error, r.error
        # every survivor gives up within the configured timeout of the failure (plus the cascade of one more)
        assert r.elapsed_s < 3 * TIMEOUT_S + 20, f"rank {r.rank} took {r.elapsed_s:.1f} s"
    if layout == "ep":
        # mesh (pp=2, dp=2): pipelines (0, 2) and (1, 3), EP groups (0, 1) and (2, 3). Which op each survivor is in
        # when the failure cascades to it depends on timing, but a P2P error names the global rank of a pipeline
        # neighbour, a collective its own EP group, and someone names the dead rank 1.
        neighbour, ep_group = {0: 2, 2: 0, 3: 1}, {0: "(ranks 0, 1)", 2: "(ranks 2, 3)", 3: "(ranks 2, 3)"}
        for r in others:
            peer = re.search(r"(?:from|to) rank (\d+)", r.error)
            if peer:
                assert int(peer.group(1)) == neighbour[r.rank], r.error
            elif "EP group" in r.error:
                assert re.search(r"A2A_\w+/s\d+/mb\d+/L\d+\S* in the EP group " + re.escape(ep_group[r.rank]),
                                 r.error), r.error
        assert any(re.search(r"(from|to) rank 1\b|\(ranks 0, 1\)", r.error) for r in others), \
            [r.error for r in others]
    if mode == "hang":
        assert any("timed out after 4 s" in r.error for r in others), [r.error for r in others]
        assert results[1].exitcode is None  # the hung rank was killed by the launcher, not by itself
    else:
        assert results[1].exitcode == 1
    assert wall < 60
