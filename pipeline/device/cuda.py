"""The device layer on a real GPU: torch.cuda, with streams of our own made non-blocking (layer.py)."""
from __future__ import annotations

import contextlib
import ctypes

import torch

from pipeline.device.poll import poll

CUDA_STREAM_NON_BLOCKING = 0x01  # cudaStreamNonBlocking (CUDA runtime API, cudaStreamCreateWithFlags)


def _cudart():
    """The CUDA runtime library torch loaded (read from this process's memory map), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


class CudaDevice:
    name = "cuda"

    def __init__(self, device: torch.device):
        self.device = device
        self._rt = None
        self.streams: list = []  # (stream, role, flags): what the run made, for gpu_check's report

    def new_stream(self, role: str, priority: int = 0, blocking: bool = False):
        """A stream of our own, outside torch's pool (ProcessGroupNCCL draws its streams from the pool too: a pool
        stream could be a communicator's): cudaStreamCreateWithPriority with cudaStreamNonBlocking through the CUDA
        runtime torch loaded; where that library cannot be reached, a pool stream (non-blocking too) at a priority
        level NCCL's streams do not use."""
        flags = 0 if blocking else CUDA_STREAM_NON_BLOCKING
        self._rt = self._rt or _cudart()
        stream = None
        if self._rt is not None:
            handle = ctypes.c_void_p(0)
            with torch.cuda.device(self.device):
                err = self._rt.cudaStreamCreateWithPriority(ctypes.byref(handle), ctypes.c_uint(flags),
                                                            ctypes.c_int(priority))
            if err == 0 and handle.value:
                stream = torch.cuda.ExternalStream(handle.value, device=self.device)
        if stream is None:
            if blocking:
                raise RuntimeError("a blocking stream needs the CUDA runtime library, which was not found")
            stream = torch.cuda.Stream(self.device, priority=priority if priority < 0 else -2)
        self.streams.append((stream, role, "blocking" if blocking else "non-blocking"))
        return stream

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def use(self, stream):
        return torch.cuda.stream(stream)

    def event(self, timing: bool = False):
        return torch.cuda.Event(enable_timing=timing)

    def wait_work(self, work, stream=None) -> None:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            work.wait()  # stream-ordered (no blocking wait: pipeline.distributed.p2p.override_blocking_wait)

    def work_done(self, work) -> bool:
        return work.is_completed()

    def host_wait_work(self, work, limit_s: float) -> bool:
        if not poll(work.is_completed, limit_s):
            return False
        work.wait()
        return True

    def read_later(self, tensors, stream):
        with torch.cuda.stream(stream):
            flat = torch.cat(tensors) if len(tensors) > 1 else tensors[0]
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        for t in (*tensors, flat):
            t.record_stream(stream)
        return done, (lambda: host)

    def post(self, post, *, comm, members, ops, tensors):
        return post()

    def backend_view(self, t):
        return t

    def record_stream(self, t, stream) -> None:
        t.record_stream(stream)

    def pinned(self, t):
        return t.pin_memory()

    def bind_thread(self) -> None:
        torch.cuda.set_device(self.device)

    def kernel(self, name: str) -> None:
        pass

    def mark(self, name: str) -> None:
        pass

    def host_wait_events(self, events, limit_s: float) -> bool:
        return poll(lambda: all(ev.query() for ev in events), limit_s)

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_memory(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device)

    def rng_state(self) -> torch.Tensor | None:
        return torch.cuda.get_rng_state(self.device)

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        if state is not None:
            torch.cuda.set_rng_state(state, self.device)

    def close(self, program_dir=None, complete: bool = True) -> None:
        pass
