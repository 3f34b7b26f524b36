"""What a run does with its checkpoint folder: resume, start fresh, or refuse; when it saves; which checkpoints it
keeps. A checkpoint is never lost to a relaunch that forgot a flag.

Resume (`decide_resume`, on every rank and by `mhcpipe run` before any process group exists, so every rank decides
alike from the same folder):
* the folder holds a complete checkpoint (`latest`) of this model config: the run resumes from it by default (as
  torchtitan does), so a relaunch after a crash, or a torchrun restart (`--max-restarts`), continues where the
  last save left off; `--resume` insists on it (no checkpoint: one line);
* a checkpoint of another model config: refused in one line naming the first differing field, unless
  `--overwrite` (then the run starts fresh and its saves replace the old checkpoints);
* `--no-resume` on a folder holding checkpoints: refused in one line unless `--overwrite`;
* an empty folder, or one without `latest` (nothing complete was ever published): a fresh run.
A damaged `latest` checkpoint is refused in one line naming the file and the fix (pipeline.checkpoint.files), never
silently started over.

Saving (`should_save`): after every `train.checkpoint_every`-th step and after the last; `train.keep_checkpoints`
complete checkpoints are kept, the newest (pipeline.checkpoint.files.prune, by rank 0 after publishing).

Folder names: step_<k> holds the state after the step the log prints as k+1 of N (k counts from 0, as the
manifest's "step" does): `--steps N` on a resume means N steps in all, and step_<N-1> is the last.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the type of every `cfg` here; configs is imported where it is used
    from configs import RunConfig

from pathlib import Path

from pipeline.checkpoint.files import LATEST



def decide_resume(directory: Path, cfg: RunConfig, resume: bool | None, overwrite: bool) -> tuple[bool, str | None]:
    """(resume?, the line to print) for a run of `cfg` with checkpoint folder `directory`; `resume`: True
    (--resume), False (--no-resume) or None (decide); one-line ValueError when the run must not start."""
    from pipeline.checkpoint.dcp import ModelMismatch, resume_meta

    directory = Path(directory)
    has = (directory / LATEST).exists()
    if resume is True:
        meta = resume_meta(directory, cfg)
        return True, f"resuming from {meta['path']} (step {meta['step'] + 1} done)"
    if not has:
        if (directory / "latest.json").exists():  # an old-format folder: its own one line (convert it)
            resume_meta(directory, cfg)
        return False, None
    if resume is False:
        if overwrite:
            return False, f"--overwrite: starting fresh; the saves replace the checkpoints in {directory}"
        raise ValueError(f"--no-resume: {directory} holds checkpoints ({LATEST}: "
                         f"{(directory / LATEST).read_text(errors='replace').strip()}) that a fresh run would "
                         "replace; resume them (drop --no-resume), use another --checkpoint-dir, or add --overwrite")
    try:
        meta = resume_meta(directory, cfg)
    except ModelMismatch as err:
        if overwrite:
            return False, f"--overwrite: starting fresh; the saves replace the checkpoints in {directory}"
        raise ValueError(f"{directory} holds checkpoints, which a run resumes by default: {err.step_dir} was written "
                         f"by another model config ({err.diff}); run with that config, use another "
                         "--checkpoint-dir, or add --overwrite") from None
    return True, f"resuming from {meta['path']} (step {meta['step'] + 1} done; --no-resume --overwrite starts fresh)"


def should_save(step: int, cfg: RunConfig) -> bool:
    """Save after step `step` (counting from 0)? Every checkpoint_every-th step and the last."""
    return (step + 1) % cfg.train.checkpoint_every == 0 or step == cfg.train.steps - 1
