"""A plain user Transformer (attention and MLP sub-layers, nothing of mHC in it) that mhc-pipe wraps in the residual
`--residual` names: `residual:1` is x + F(x), `mhc:4` mHC with 4 streams (pipeline.user_model.from_sublayers).

    torchrun --nproc-per-node 4 examples/plain_transformer.py --schedule dualpipev --residual mhc:4 --steps 3
    mhcpipe check-split examples/plain_transformer.py:build --residual mhc:4

`build_meta` builds the same model on the meta device: each rank then allocates and initialises only its own
stages' pieces (pipeline.user_materialise), so a model larger than one host's memory runs split.
"""
from __future__ import annotations

import torch
from transformer_parts import CausalAttention, LMHead, PreNorm, SwiGLU, token_loss
from torch import nn

from mhcpipe.user import DeferLinear, UserModel, run

VOCAB, HIDDEN, HEADS, FFN, BLOCKS = 256, 64, 4, 128, 8


def build(residual: str = "residual:1", seq_len: int = 32, hidden: int = HIDDEN, ffn: int = FFN,
          blocks: int = BLOCKS) -> UserModel:
    """Its projections are DeferLinear (pipeline.weight_grad): under ZB1P and DualPipe their weight-gradients move
    from I to W, as the built-in model's do (with nn.Linear I computes them and W is empty)."""
    sublayers = []
    for _ in range(blocks):
        sublayers += [PreNorm(hidden, CausalAttention(hidden, HEADS, DeferLinear), seq_len),
                      PreNorm(hidden, SwiGLU(hidden, ffn, DeferLinear), seq_len)]
    return UserModel.from_sublayers(embed=nn.Embedding(VOCAB, hidden), sublayers=sublayers,
                                    head=LMHead(hidden, VOCAB), loss=token_loss, hidden=hidden, vocab_size=VOCAB,
                                    residual=residual, name="plain-transformer")


def build_meta(residual: str = "residual:1", seq_len: int = 32, hidden: int = HIDDEN, ffn: int = FFN,
               blocks: int = BLOCKS) -> UserModel:
    """The same model built on the meta device (shapes only); `hidden`, `ffn`, `blocks` size it."""
    with torch.device("meta"):
        return build(residual, seq_len, hidden, ffn, blocks)


if __name__ == "__main__":
    run(build)
