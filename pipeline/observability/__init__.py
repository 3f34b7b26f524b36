"""What a run records about itself: the NVTX-annotated span recorder that writes the measured trace (recorder), and
the per-layer residual-stream diagnostics, probed in the stage (diagnostics_probe), logged per step
(diagnostics_log) and read back as tables and a picture (diagnose, `mhcpipe diagnose`).

May import: pipeline.distributed (the recorder's clock alignment is a collective) and pipeline.device (its events).

Also: `fr_setup` (Flight Recorder's settings, the op ledgers and their way to rank 0).
"""
