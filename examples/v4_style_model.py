"""A DeepSeek-V4-style decoder whose blocks carry more than the streams: each block's MLP write-back is deferred.
The MLP output is not added to the n streams where it is computed; it travels on as an fp32 term [T, C] beside
them, and the next block (or the head) writes it into the streams before reading them, as V4 defers its
post/combine. A pipeline that sends only the streams across a stage boundary loses that term (torchtitan's V4
pipeline dropped `hc_head` and re-expanded the streams on later stages); here the state between blocks is the tuple
(streams [T, n, C], deferred [T, C] fp32), declared as `extra_state`, and mhc-pipe sends both as one message:

    torchrun --nproc-per-node 4 examples/v4_style_model.py --schedule dualpipev --steps 3
    mhcpipe check-split examples/v4_style_model.py:build
"""
from __future__ import annotations

import torch
from torch import nn
from transformer_parts import CausalAttention, LMHead, PreNorm, SwiGLU, token_loss

from kernels import MHCConfig, MHCSublayer
from mhcpipe.user import StatePart, UserModel, run

VOCAB, HIDDEN, HEADS, FFN, BLOCKS, STREAMS = 256, 64, 4, 128, 8, 4


class Entry(nn.Module):
    """h [T, C] -> (n copies [T, n, C], no deferred write yet [T, C] fp32)."""

    def forward(self, h: torch.Tensor):
        return h.unsqueeze(1).expand(-1, STREAMS, -1).contiguous(), torch.zeros(h.shape, dtype=torch.float32)


class DeferredWrite(nn.Module):
    """Writes a deferred term into the streams with learned per-stream weights (what the producing sub-layer's
    H_post would have done): x + w[n] d[T, C]."""

    def __init__(self):
        super().__init__()
        self.post = nn.Parameter(torch.full((STREAMS,), 1.0 / STREAMS))

    def forward(self, x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return x + (self.post[None, :, None] * d[:, None, :]).to(x.dtype)


class V4Block(nn.Module):
    """(streams, deferred) -> (streams, deferred): the previous MLP's deferred write, attention in mHC, then an
    MLP that reads the streams (a learned mix) and defers its own write in fp32."""

    def __init__(self, index: int, seq_len: int):
        super().__init__()
        self.write = DeferredWrite()
        self.attn = MHCSublayer(MHCConfig(variant="mhc", n=STREAMS), PreNorm(HIDDEN, CausalAttention(HIDDEN, HEADS),
                                                                           seq_len), HIDDEN, layer_index=2 * index)
        self.read = nn.Parameter(torch.zeros(STREAMS))
        self.mlp = PreNorm(HIDDEN, SwiGLU(HIDDEN, FFN), seq_len)

    def forward(self, state):
        x, d = state
        x = self.attn(self.write(x, d))
        h = (x * self.read.softmax(0)[None, :, None].to(x.dtype)).sum(1)
        return x, self.mlp(h).float()


class V4Head(nn.Module):
    """The last deferred write, the mean over the streams, norm and output projection."""

    def __init__(self):
        super().__init__()
        self.write = DeferredWrite()
        self.lm = LMHead(HIDDEN, VOCAB)

    def forward(self, state) -> torch.Tensor:
        x, d = state
        return self.lm(self.write(x, d).mean(1))


def build(seq_len: int = 32) -> UserModel:
    return UserModel(embed=nn.Embedding(VOCAB, HIDDEN), expand=Entry(),
                     blocks=[V4Block(i, seq_len) for i in range(BLOCKS)], head=V4Head(), loss=token_loss,
                     n=STREAMS, hidden=HIDDEN, vocab_size=VOCAB, name="v4-style-deferred",
                     extra_state=[StatePart("deferred", (HIDDEN,), torch.float32)])


if __name__ == "__main__":
    run(build)
