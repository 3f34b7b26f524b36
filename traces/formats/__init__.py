"""Trace formats in and out: `io.load_trace` reads any of them by content (a file or a run folder); `chrome`
(Chrome/Perfetto JSON, both ways), `kineto` (PyTorch profiler JSON, read event by event through `json_stream`, a
JSON object's array element by element), `nsys` (Nsight Systems SQLite export),
`nsys_csv` (`nsys stats` NVTX CSV), `project` (CPU ranges projected onto the GPU work they launched), and
`flight_recorder` (NCCL Flight Recorder dumps, read through an allow-list unpickler). All produce a
`traces.trace.Trace`.

`npz`: our own trace as binary columns (`.npz`, docs/traces.md §8), for long runs: read at disk speed, its steps
found on the columns.

`cuda_program`: the emulated CUDA device's per-rank programs (docs/cuda_program.md).
"""
