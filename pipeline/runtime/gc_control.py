"""Garbage collection during a run: automatic collection off, a full pass every few steps that walks only what
the run created (pipeline.runtime.train and the benchmarks that drive runtimes themselves use it)."""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def manual_gc(interval: int):
    """Automatic garbage collection off for the run (a generation-2 pass inside an action stalls that rank and,
    through the pipeline, every rank); yields collect(step), a full pass every `interval` steps that only walks
    objects created since the start (the rest is frozen).
    interval 0: automatic collection stays on. The previous setting is restored at the end, and the frozen objects
    are unfrozen unless the process had frozen some before (one that runs many runs, such as the tests' rank
    processes, freezes its imports once: unfreezing them would make every later pass walk them again)."""
    if interval <= 0:
        yield lambda step: None
        return
    was_enabled = gc.isenabled()
    owner = gc.get_freeze_count() == 0
    gc.collect()
    gc.freeze()  # what exists now (modules, the model) is never garbage: keep it out of every later pass
    gc.disable()

    def collect(step: int) -> None:
        if (step + 1) % interval == 0:
            gc.collect()

    try:
        yield collect
    finally:
        if owner:
            gc.unfreeze()
        if was_enabled:
            gc.enable()
