"""Checkpoints through torch.distributed.checkpoint, keyed by the single-process model's parameter names so a run
resumes on another layout (dcp: save, load, resume checks, the old-format converter), and the files of a
checkpoint folder: manifest, hashes, `latest`, the allow-listed metadata unpickler (files), and what a run does
with its folder: resume by default, refuse what would lose checkpoints, save interval, keep-last-N (policy), and
saves staged to host memory and written in the background (async_save).

May import: pipeline.distributed and the model modules at the top of pipeline (model, partition, weight_grad, data).
"""
