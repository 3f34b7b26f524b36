"""Trace formats in and out: `io.load_trace` reads any of them by content (a file or a run folder); `chrome`
(Chrome/Perfetto JSON, both ways), `kineto` (PyTorch profiler JSON), `nsys` (Nsight Systems SQLite export),
`nsys_csv` (`nsys stats` NVTX CSV), `project` (CPU ranges projected onto the GPU work they launched), and
`flight_recorder` (NCCL Flight Recorder dumps, read through an allow-list unpickler). All produce a
`traces.trace.Trace`.

`cuda_program`: the emulated CUDA device's per-rank programs (docs/cuda_program.md).
"""
