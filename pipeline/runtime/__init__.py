"""Executing a schedule on one rank: the per-rank runtime and training loop (train), the action executor (executor),
a stage's forward/backward with its mHC sub-layers (stage) or a user model's blocks (user_stage, with boundary: a
state of several tensors as one message), the overlapped
F&B pair (overlap), the guard against non-finite losses and gradients (nonfinite), recompute in blocks
(recompute, saved_tensors), garbage collection during a run (gc_control),
and binding a rank to cores (cpu_binding).

May import: pipeline.device, pipeline.distributed, pipeline.observability, pipeline.checkpoint and the model
modules at the top of pipeline.
"""
