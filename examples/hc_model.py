"""A decoder written with the `hyper-connections` library (0.4.11, PyPI): its mHC
(`mc_get_init_and_expand_reduce_stream_functions`) around each attention and MLP branch, its stream expansion and
its stream reduction (a sum) in the head; the last block's MLP is hash-routed (experts chosen by token id). Run by
mhc-pipe as it is:

    torchrun --nproc-per-node 4 examples/hc_model.py --schedule dualpipev --steps 3 --trace-dir runs/hc
    mhcpipe check-split examples/hc_model.py:build

Each block exposes its phases (attention, MLP), so the halves of an F&B pair interleave at them.
`build_ours` is the same model with mhc-pipe's own mHC kernels around the same branches (kernels.MHCSublayer,
pipeline.user_model.from_sublayers) instead of the library's.

The library keeps streams folded into the batch, `(b s) ... d`; mhc-pipe's state is [T, n, C], T = B x S tokens. A
block turns [T, n, C] into the library's [(B n), S, C] for its branches and back.
"""
from __future__ import annotations

import torch
from hyper_connections import mc_get_init_and_expand_reduce_stream_functions
from torch import nn
from plain_transformer import build as build_plain
from transformer_parts import CausalAttention, HashRoutedMLP, LMHead, SwiGLU, token_loss

from mhcpipe.user import UserModel, run

VOCAB, HIDDEN, HEADS, FFN, BLOCKS, STREAMS, EXPERTS = 256, 64, 4, 128, 8, 4, 4


class Branch(nn.Module):
    """Pre-norm then the core, on the library's [(B n), S, C] branch input; `token_ids` for a hash-routed core."""

    def __init__(self, core: nn.Module):
        super().__init__()
        self.norm = nn.RMSNorm(HIDDEN, eps=1e-6)
        self.core = core

    def forward(self, h: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm(h)
        return self.core(h) if token_ids is None else self.core(h, token_ids)


class HCBlock(nn.Module):
    """Attention and MLP, each in the library's mHC: [T, n, C] -> [T, n, C]."""

    def __init__(self, index: int, init_hc, seq_len: int, hashed: bool):
        super().__init__()
        self.seq_len = seq_len
        self.needs_token_ids = hashed  # mhc-pipe then calls block(x, token_ids=ids) with the real ids
        mlp = HashRoutedMLP(HIDDEN, FFN, EXPERTS) if hashed else SwiGLU(HIDDEN, FFN)
        self.attn = init_hc(dim=HIDDEN, branch=Branch(CausalAttention(HIDDEN, HEADS)), layer_index=2 * index)
        self.mlp = init_hc(dim=HIDDEN, branch=Branch(mlp), layer_index=2 * index + 1)

    def phases(self):
        """mhc-pipe's F&B pair hands the turn to the other half between these (pipeline.user_model)."""
        return [("attention", self.attention), ("mlp", self.mlp_phase)]

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.mlp_phase(self.attention(x), token_ids)

    def attention(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self._library_layout(x, self.attn)

    def mlp_phase(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        if token_ids is None:
            return self._library_layout(x, self.mlp)
        # the library's width connection hands the branch one [B, S, C] input (the streams mixed)
        return self._library_layout(x, lambda r: self.mlp(r, token_ids.view(-1, self.seq_len)))

    def _library_layout(self, x: torch.Tensor, hc) -> torch.Tensor:
        t, n, c = x.shape
        b, s = t // self.seq_len, self.seq_len
        r = hc(x.view(b, s, n, c).transpose(1, 2).reshape(b * n, s, c))  # the library's (b s) layout
        return r.view(b, n, s, c).transpose(1, 2).reshape(t, n, c)


class LibraryExpand(nn.Module):
    """The library's expand_stream on [T, C] tokens: [(T n), C] -> mhc-pipe's [T, n, C]."""

    def __init__(self, expand_stream):
        super().__init__()
        self.expand_stream = expand_stream

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.expand_stream(h).view(h.shape[0], STREAMS, h.shape[1])


class LibraryHead(nn.Module):
    """The library's reduce_stream (a sum over the streams), then norm and the output projection."""

    def __init__(self, reduce_stream):
        super().__init__()
        self.reduce_stream = reduce_stream
        self.lm = LMHead(HIDDEN, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.reduce_stream(x.reshape(-1, x.shape[-1])))


def build(seq_len: int = 32) -> UserModel:
    init_hc, expand_stream, reduce_stream = mc_get_init_and_expand_reduce_stream_functions(STREAMS)
    blocks = [HCBlock(i, init_hc, seq_len, hashed=i == BLOCKS - 1) for i in range(BLOCKS)]
    return UserModel(embed=nn.Embedding(VOCAB, HIDDEN), expand=LibraryExpand(expand_stream), blocks=blocks,
                     head=LibraryHead(reduce_stream), loss=token_loss, n=STREAMS, hidden=HIDDEN, vocab_size=VOCAB,
                     name="hyper-connections-mhc")


def build_ours(seq_len: int = 32, residual: str = f"mhc:{STREAMS}") -> UserModel:
    """The same branches (pre-norm attention and SwiGLU, dense: a wrapped sub-layer gets no token ids) in mhc-pipe's
    mHC: the plain Transformer of plain_transformer.py with `residual`."""
    model = build_plain(residual, seq_len)
    model.name = "hc-model-ours"
    return model


if __name__ == "__main__":
    run(build)
