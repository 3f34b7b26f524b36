"""Failures end the run quickly and clearly: a rank that dies mid-step, a rank that hangs mid-step."""
from __future__ import annotations

import os
import re
import time

import pytest

from _pipeline_helpers import tiny_config
from pipeline.local import launch, variants_worker

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


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind,mode", [("dualpipev", "die"), ("1f1b", "hang")])
def test_failed_rank_stops_the_others(kind, mode):
    cfg = tiny_config(kind, 4, timeout_s=TIMEOUT_S, steps=1)
    started = time.monotonic()
    results = launch(variants_worker, 4, ([cfg], False, StopAt(1, 6, mode)), timeout_s=60,
                     grace_s=3 * TIMEOUT_S + 5)
    wall = time.monotonic() - started
    others = [r for r in results if r.rank != 1]
    for r in others:
        assert r.exitcode == 1, f"rank {r.rank} exit code {r.exitcode} (None = still running at the deadline)"
        assert r.error and r.error.startswith(f"rank {r.rank}: "), r.error
        assert re.search(r"(SEND|RECV)_[FB]/s\d+/mb\d+|all-reduce|barrier", r.error), r.error
        assert "timed out after" in r.error or "closed its connection" in r.error, r.error
        # every survivor gives up within the configured timeout of the failure (plus the cascade of one more)
        assert r.elapsed_s < 3 * TIMEOUT_S + 20, f"rank {r.rank} took {r.elapsed_s:.1f} s"
    if mode == "hang":
        assert any("timed out after 4 s" in r.error for r in others), [r.error for r in others]
        assert results[1].exitcode is None  # the hung rank was killed by the launcher, not by itself
    else:
        assert results[1].exitcode == 1
    assert wall < 60
