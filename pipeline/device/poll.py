"""Bounded host waits without a busy core: the one polling loop every host wait of the runtime uses (a CUDA event
query, an NCCL work's completion, a gloo work's), here at the bottom so that the device layer and
pipeline.distributed share it."""
from __future__ import annotations

import time


def poll(done, timeout_s: float) -> bool:
    """True once `done()` is; False after `timeout_s`. Sleeps between polls (10 µs doubling to 1 ms), so a
    waiting host costs no core."""
    deadline = time.monotonic() + timeout_s
    pause = 1e-5
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
    return True
