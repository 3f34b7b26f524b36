"""The schedule registry (schedules/registry.py) is the one list of schedule kinds and their facts: a sixth kind,
added here through `register` alone (its generator is GPipe's order under another name), is accepted by config
validation, every command line that takes a schedule, the cost model and the runtime's plan, and traces carry its
facts."""
from __future__ import annotations

import contextlib
import dataclasses
import io

import pytest

from schedules.gpipe import gpipe
from schedules.registry import ScheduleKind, kind_of, names, register, unregister


def toy(num_ranks: int, num_microbatches: int):
    return dataclasses.replace(gpipe(num_ranks, num_microbatches), kind="toy")


@pytest.fixture
def toy_kind():
    register(ScheduleKind("toy", toy, summary="GPipe's order under a new name"))
    try:
        yield
    finally:
        unregister("toy")
    assert "toy" not in names()


def _mhcpipe(*args: str) -> tuple[int, str, str]:
    from mhcpipe.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(args))
        except SystemExit as stop:
            rc = stop.code
    return rc, out.getvalue(), err.getvalue()


def test_the_five_kinds_and_their_facts():
    assert names() == ("gpipe", "1f1b", "zb1p", "dualpipe", "dualpipev")
    assert [kind_of(k).model_chunks(4) for k in names()] == [4, 4, 4, 4, 8]
    assert [kind_of(k).mirrors for k in names()] == [False, False, False, True, False]
    assert kind_of("DualPipe-V").name == "dualpipev"
    with pytest.raises(ValueError, match="unknown schedule kind 'nope'; choose one of gpipe, 1f1b"):
        kind_of("nope")
    with pytest.raises(ValueError, match="registered already"):
        register(ScheduleKind("gpipe", gpipe))


def test_a_sixth_kind_through_the_registry_alone_reaches_every_consumer(toy_kind, tmp_path):
    from configs import load_config, parse_config
    from pipeline.launch.entry import add_run_arguments
    from pipeline.partition import plan_rank
    from schedules import build

    # config validation and the runtime's plan
    data = load_config("tiny").model_dump()
    data["parallel"].update(schedule="toy", ranks=4)
    cfg = parse_config(data)
    assert cfg.parallel.schedule == "toy" and cfg.parallel.num_stages == 4
    plan = plan_rank(cfg, 0, build("toy", 4, cfg.parallel.microbatches))
    assert plan.mirror is None and len(plan.local()) == 1
    # the torchrun entry's flags (and `mhcpipe run`'s, which are the same)
    import argparse

    p = argparse.ArgumentParser()
    add_run_arguments(p)
    assert p.parse_args(["--schedule", "toy"]).schedule == "toy"
    # the schedule CLI, the cost model, the tuner, the layout, check-split's flag
    rc, out, err = _mhcpipe("schedule", "--kind", "toy", "--ranks", "4", "--microbatches", "8")
    assert rc == 0, err
    rc, out, err = _mhcpipe("predict", "--preset", "tiny", "--hardware", "h800", "--schedule", "toy", "--pp", "4",
                            "--json", str(tmp_path / "p.json"))
    assert rc == 0, err
    assert '"kind": "toy"' in (tmp_path / "p.json").read_text()
    rc, out, err = _mhcpipe("tune", "--preset", "tiny", "--hardware", "h800", "--gpus", "4", "--schedules", "toy",
                            "--memory-gib", "80", "--global-batch", "16")
    assert rc == 0 and "toy" in out, err
    rc, out, err = _mhcpipe("layout", "--config", "tiny", "--schedule", "toy", "--pp", "4")
    assert rc == 0 and "toy PP4" in out, err
    from mhcpipe.check_split_cli import parse_schedules

    assert "toy" in parse_schedules("all") and parse_schedules("toy") == ["toy"]
    # a simulated trace carries the kind's facts, which traces/ reads without importing schedules
    from schedules import Durations, simulate

    trace = simulate(build("toy", 2, 4), Durations(F=1, I=1, W=1)).trace
    assert trace.meta["schedule"]["kind"] == "toy" and trace.meta["schedule"]["mirrors"] is False
