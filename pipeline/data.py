"""Training data: seeded synthetic tokens (default) or windows of a token file, split into micro-batches.

Shape letters: M micro-batches, B sequences per micro-batch, S sequence length. One step's batch is
inputs/labels [M, B, S] (labels = inputs shifted by one token). The batch depends only on (config, step), so
every rank, the single-process reference and a resumed run see the same tokens.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the type of every `cfg` here; configs is imported where it is used
    from configs import RunConfig

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass(frozen=True)
class Batch:
    inputs: torch.Tensor  # [M, B, S] int64
    labels: torch.Tensor  # [M, B, S] int64

    @property
    def num_tokens(self) -> int:
        return self.labels.numel()

    def microbatch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids [T], labels [T]) of global micro-batch `index`, T = B x S."""
        return self.inputs[index].reshape(-1), self.labels[index].reshape(-1)


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1_000_003 * (seed + 1) + step)


def load_tokens(path: str | Path) -> np.ndarray:
    """A token file: `.npy` (any integer dtype) or raw little-endian uint16 `.bin` (nanoGPT style)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"train.data: token file {path} does not exist (use 'synthetic' or a .npy/.bin path)")
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
    elif path.suffix == ".bin":
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
    else:
        raise ValueError(f"train.data: {path} must end in .npy or .bin (raw uint16)")
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"train.data: {path} must hold a 1-D integer array of token ids")
    return tokens


def make_batch(cfg: RunConfig, step: int, tokens: np.ndarray | None = None) -> Batch:
    """The batch of optimizer step `step` (0-based) for RunConfig `cfg`."""
    par, vocab = cfg.parallel, cfg.model.vocab_size
    m, b, s = par.microbatches, par.microbatch_size, par.seq_len
    gen = _generator(cfg.train.seed, step)
    if cfg.train.data == "synthetic":
        seqs = torch.randint(0, vocab, (m, b, s + 1), generator=gen)
    else:
        if tokens is None:
            tokens = load_tokens(cfg.train.data)
        if len(tokens) < s + 2:
            raise ValueError(f"train.data: token file has {len(tokens)} tokens, fewer than seq_len+1 = {s + 1}")
        starts = torch.randint(0, len(tokens) - s - 1, (m * b,), generator=gen).tolist()
        seqs = torch.from_numpy(np.stack([np.asarray(tokens[i:i + s + 1], dtype=np.int64) for i in starts]))
        seqs = seqs.view(m, b, s + 1)
        if int(seqs.max()) >= vocab:
            raise ValueError(f"train.data: token id {int(seqs.max())} >= model.vocab_size={vocab}")
    return Batch(seqs[..., :-1].contiguous(), seqs[..., 1:].contiguous())
