"""What the runtime asks of a CUDA device, as one typed interface (docs/cuda_program.md §Device layer).

The rules this interface lets the runtime follow, each a test under the emulated device
(tests/pipeline/test_pipeline_cuda_emulation.py) and each with its source in docs/cuda_program.md §Rules:
* every stream the runtime makes is *non-blocking*: a blocking stream and the legacy default stream (where the
  model's kernels run) order each other both ways, so a wait parked on it for an early-posted receive would
  hold every later kernel of the rank;
* a posted op's end is waited for on a stream of its own (`wait_work` on an end stream), never on a stream another
  op or the compute stream uses;
* the host reads a device tensor only through `read_later`, whose copy is queued behind what produces the tensor
  and nothing else, and is polled with a deadline;
* a tensor an NCCL op reads or writes stays referenced until the host saw the op's end (`backend_view` marks the
  tensors whose release the emulated device watches).
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch


class Event(Protocol):
    def record(self, stream=None) -> None: ...
    def query(self) -> bool: ...
    def elapsed_time(self, end: "Event") -> float: ...  # milliseconds, as torch.cuda.Event


class Stream(Protocol):
    def wait_stream(self, other: "Stream") -> None: ...
    def wait_event(self, event: Event) -> None: ...


class Device(Protocol):
    """One rank's CUDA device (real or emulated)."""

    name: str  # "cuda" or "emulated-cuda"

    def new_stream(self, role: str, priority: int = 0, blocking: bool = False) -> Stream:
        """A stream of the runtime's own (role: hp, comm or end; it names the stream in programs). Non-blocking
        unless `blocking` (tests reproduce the blocking-stream deadlock with it)."""

    def current_stream(self) -> Stream: ...

    def use(self, stream: Stream):
        """Context manager: kernels and posts of this thread go to `stream` inside it."""

    def event(self, timing: bool = False) -> Event: ...

    def wait_work(self, work, stream: Stream | None = None) -> None:
        """Order `stream` (default: the current one) behind a posted op's end; the host does not wait."""

    def work_done(self, work) -> bool:
        """Has the posted op completed? (non-blocking)"""

    def host_wait_work(self, work, limit_s: float) -> bool:
        """Block the host until the posted op completed or `limit_s` passed (False), polling."""

    def read_later(self, tensors: list[torch.Tensor], stream: Stream) -> tuple[Event, Callable[[], torch.Tensor]]:
        """Queue a copy of cat(tensors) to host memory on `stream`: (its event, the reader of the host copy, to call
        once the event completed)."""

    def post(self, post: Callable[[], list], *, comm: str, members: list[int], ops: list[tuple],
             tensors: list[torch.Tensor]) -> list:
        """Issue one batch of communication (`post()` returns its works, or one work) on communicator `comm` from
        the current stream; ops: (kind, peer global rank or None, name) each."""

    def backend_view(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor to hand the backend for `t` (the runtime keeps `t` referenced until the op's end)."""

    def record_stream(self, t: torch.Tensor, stream: Stream) -> None: ...
    def pinned(self, t: torch.Tensor) -> torch.Tensor: ...
    def bind_thread(self) -> None: ...
    def kernel(self, name: str) -> None: ...
    def mark(self, name: str) -> None: ...
    def host_wait_events(self, events: list[Event], limit_s: float) -> bool: ...
    def reset_peak_memory(self) -> None: ...
    def peak_memory(self) -> int | None: ...
    def rng_state(self) -> torch.Tensor | None: ...  # the device generator's state (a recompute replays it)
    def set_rng_state(self, state: torch.Tensor | None) -> None: ...
    def close(self, program_dir=None, complete: bool = True) -> None: ...


def device_layer(device: torch.device, *, emulate: bool, rank: int, world: int, timeout_s: float) -> Device | None:
    """The run's device layer: the emulated CUDA device (`train.emulate_cuda`, CPU tensors), CUDA on a GPU, else
    None (a CPU run: its waits block the host)."""
    if emulate:
        if device.type != "cpu":
            raise ValueError("train.emulate_cuda (--emulate-cuda) runs the CUDA path on CPU tensors: use "
                             "--device cpu, or drop --emulate-cuda on a GPU")
        from pipeline.device.emulated import EmulatedCuda

        return EmulatedCuda(rank, world, timeout_s)
    if device.type == "cuda":
        from pipeline.device.cuda import CudaDevice

        return CudaDevice(device)
    return None
