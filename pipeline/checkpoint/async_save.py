"""Saving while training: the loop's `Checkpointer` (which steps save, synchronously or not, and how long each
save held the loop) and asynchronous checkpoints (train.checkpoint_async, --async-checkpoint): the step goes on
while the previous checkpoint is written.

The main thread only stages: after the optimizer step it copies this rank's keys (parameters, AdamW state) to host
memory, as torchtitan and Megatron stage before writing, and hands the copy to one background thread, which runs
the same save as the synchronous path (pipeline.checkpoint.dcp.save: tmp folder, DCP shards, barrier, manifest,
atomic rename, `latest`, prune). Its barriers and DCP's collectives run on a process group of their own (gloo,
every rank, made at start-up): collectives of two threads on one communicator could pair up across threads, and
the training's groups stay the main thread's alone (torchtitan makes a gloo group for its async saves too).

At most one save is in flight: the next save, and the end of the run, first wait for it (that wait and the
staging copy are what a step is blocked for: `blocked_s`). A save that failed in the background is raised at that
wait, in one line; a rank killed while its thread writes leaves `latest` naming the previous complete checkpoint,
exactly as a synchronous save would. A CUDA tensor's copy is ordered after the optimizer step on its stream and
waited for by the host before the thread starts.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from pipeline.checkpoint import dcp


class Checkpointer:
    """The training loop's saves: after each step that policy.should_save names, synchronous (dcp.save) or staged
    and written in the background (AsyncSaver, train.checkpoint_async); `finish()` waits for the last. Keeps the
    time each save held the loop, for `summary`."""

    def __init__(self, directory: Path, rt):
        self.directory, self.rt = Path(directory), rt
        self.saver = AsyncSaver(self.directory, rt) if rt.cfg.train.checkpoint_async else None
        self.saves = 0
        self.blocked_s = 0.0

    def after_step(self, step: int) -> None:
        from pipeline.checkpoint.policy import should_save

        if not should_save(step, self.rt.cfg):
            return
        started = time.perf_counter()
        if self.saver is not None:
            self.saver.save(step)
        else:
            dcp.save(self.directory, self.rt, step)
        self.saves += 1
        self.blocked_s += time.perf_counter() - started

    def finish(self) -> None:
        if self.saver is not None:
            started = time.perf_counter()
            self.saver.wait()  # the last save published before the run ends
            self.blocked_s += time.perf_counter() - started

    def summary(self, median_step_s: float) -> str | None:
        if not self.saves:
            return None
        per = self.blocked_s / self.saves
        return (f"checkpoints: {self.saves} saved ({'asynchronous' if self.saver else 'synchronous'}), the loop "
                f"blocked {per * 1e3:.1f} ms per save ({100 * per / median_step_s:.1f}% of a median step, rank 0)")


class AsyncSaver:
    def __init__(self, directory: Path, rt):
        """Collective: every rank makes the checkpoint group."""
        import datetime

        import torch.distributed as dist

        self.directory, self.rt = Path(directory), rt
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=max(rt.timeout_s, 300.0)),
                                    group_desc="checkpoint")
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.blocked_s: list[float] = []  # per save: staging + waiting for the previous one

    def save(self, step: int) -> None:
        started = time.perf_counter()
        self.wait()
        state = {k: v.detach().to("cpu", copy=True) for k, v in dcp.state_dict(self.rt).items()}
        self.thread = threading.Thread(target=self._run, args=(step, state), name=f"checkpoint-step{step}",
                                       daemon=True)
        self.thread.start()
        self.blocked_s.append(time.perf_counter() - started)

    def _run(self, step: int, state: dict[str, torch.Tensor]) -> None:
        try:
            dcp.save(self.directory, self.rt, step, state=state, group=self.group)
        except BaseException as err:  # noqa: BLE001 - raised in the main thread at the next wait
            self.error = err

    def wait(self) -> None:
        """Until the save in flight is published; its failure is raised here."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise err
