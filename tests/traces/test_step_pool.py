"""traces/analysis/step_pool.py: per-step analyses over forked processes give the serial result in step order, a
step's error reaches the caller, and `--jobs` changes nothing in whatif but the time."""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from mhcpipe.cli import main
from traces.analysis.step_pool import MIN_STEPS, map_steps
from traces.analysis.step_select import steps_of
from traces.analysis.whatif import whatif
from traces.formats.io import load_trace
from traces.trace import Trace, TraceError

MEASURED = Path(__file__).parent / "data" / "measured_dualpipev_tiny.json.gz"


def tiled(trace: Trace, copies: int) -> Trace:
    """The run's steps repeated, each copy shifted past the last (a long run of the same steps)."""
    first, last = min(s.start for s in trace.spans), max(s.end for s in trace.spans)
    shift = (last - first) * 1.01
    spans = [replace(s, start=s.start + k * shift) for k in range(copies) for s in trace.spans]
    return Trace(spans=spans, meta={**trace.meta, "steps": int(trace.meta.get("steps", 1)) * copies})


def test_steps_in_processes_are_the_serial_map_in_order():
    table = [k * k for k in range(4 * MIN_STEPS)]  # a closure's data: found in the fork, never pickled
    got = map_steps(lambda k: (k, table[k], os.getpid()), range(2 * MIN_STEPS), jobs=2)
    assert [g[:2] for g in got] == [(k, k * k) for k in range(2 * MIN_STEPS)]
    pids = {g[2] for g in got}
    assert pids and os.getpid() not in pids  # forked workers did the steps
    assert set(map_steps(lambda k: os.getpid(), range(MIN_STEPS - 1), jobs=2)) == {os.getpid()}  # few: serial


def test_a_step_that_fails_fails_the_caller():
    def work(k: int) -> int:
        if k == 100:
            raise TraceError("step 100: no such op")
        return k

    with pytest.raises(TraceError, match="step 100: no such op"):
        map_steps(work, range(2 * MIN_STEPS), jobs=2)
    with pytest.raises(ValueError, match="--jobs 0"):
        map_steps(work, range(3), jobs=0)


def test_whatif_over_processes_is_it_in_one(tmp_path, capsys):
    run = load_trace(MEASURED)
    long = tiled(run, -(-MIN_STEPS // len(steps_of(run).steps)) + 1)
    assert len(steps_of(long).steps) >= MIN_STEPS  # the pool runs
    scales = {"F": 0.5, "comm": 0.7}
    assert whatif(long, scales, jobs=2).to_dict() == whatif(long, scales, jobs=1).to_dict()
    path = long.save(tmp_path / "long.json")
    assert main(["whatif", str(path), "--scale", "F=0.5", "--jobs", "0"]) == 2
    err = capsys.readouterr().err
    assert "--jobs 0" in err and len(err.strip().splitlines()) == 1


def test_a_worker_that_dies_is_one_error_naming_it():
    import signal

    def work(k: int) -> int:
        if k == MIN_STEPS + 5:
            os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer would
        return k

    with pytest.raises(RuntimeError, match=r"step worker \d \(pid \d+\) died without its results \(killed by SIGKILL"):
        map_steps(work, range(2 * MIN_STEPS), jobs=2)


def test_the_default_is_one_process_when_the_workers_copies_would_not_fit(monkeypatch):
    import traces.analysis.step_pool as sp

    monkeypatch.setattr(sp, "_memory", lambda: (6 << 30, 10 << 30))  # 6 GiB held, 10 available: not twice
    assert sp.default_jobs() == 1
    assert set(map_steps(lambda k: os.getpid(), range(2 * MIN_STEPS))) == {os.getpid()}
    monkeypatch.setattr(sp, "_memory", lambda: (1 << 30, 10 << 30))
    assert sp.default_jobs() == len(os.sched_getaffinity(0))
    assert map_steps(lambda k: os.getpid(), range(2 * MIN_STEPS), jobs=2)[0] != os.getpid()  # asked: forked
