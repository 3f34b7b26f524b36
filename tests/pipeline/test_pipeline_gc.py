"""Manual garbage collection in the training loop (pipeline.runtime.train.manual_gc, train.gc_interval)."""
import gc
import weakref

import pytest

from configs import load_config
from pipeline.runtime.gc_control import manual_gc


class _Node:
    pass


def _cycle() -> weakref.ref:
    node = _Node()
    node.self = node  # only a collection frees it
    return weakref.ref(node)


def test_collects_between_steps_every_interval_and_restores():
    assert gc.isenabled()
    with manual_gc(2) as collect:
        assert not gc.isenabled()
        assert gc.get_freeze_count() > 0  # what existed at the start stays out of every pass
        ref = _cycle()
        keep = [_Node() for _ in range(20000)]  # would trigger automatic collections many times over
        collect(0)  # step 1 of 2: no pass yet
        assert ref() is not None
        collect(1)
        assert ref() is None
        del keep
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_callers_frozen_objects_stay_frozen():
    """A process that froze its long-lived objects itself (the tests' rank processes) keeps them frozen after a
    run: unfreezing would make every later pass walk them again. Cycles made during the run are still freed."""
    gc.collect()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with manual_gc(1) as collect:
            ref = _cycle()
            collect(0)
            assert ref() is None
        assert gc.isenabled() and gc.get_freeze_count() >= frozen
    finally:
        gc.unfreeze()


def test_interval_zero_leaves_python_alone():
    with manual_gc(0) as collect:
        assert gc.isenabled()
        collect(0)
    assert gc.isenabled()


def test_gc_interval_is_validated():
    assert load_config("tiny").train.gc_interval == 1
    with pytest.raises(ValueError, match="gc_interval"):
        load_config("tiny", {"train": {"gc_interval": -1}})
