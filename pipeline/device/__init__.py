"""The device layer: every CUDA stream, event, stream-ordered wait, host read of a device tensor and synchronize of
the runtime goes through one small interface (layer.Device), with two implementations: `cuda` (torch.cuda, on a
GPU) and `emulated` (CPU tensors, compute at once, and per rank the program it was given, for
`mhcpipe check-comm --cuda`). A CPU run without emulation has no device layer: its waits block the host. `poll` is
the one bounded, sleeping host-wait loop, shared with pipeline.distributed.

May import: nothing else of pipeline (the bottom layer, beside distributed, which builds on it).
"""
