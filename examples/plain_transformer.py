"""A plain user Transformer (attention and MLP sub-layers, nothing of mHC in it) that mhc-pipe wraps in the residual
`--residual` names: `residual:1` is x + F(x), `mhc:4` mHC with 4 streams (pipeline.user_model.from_sublayers).

    torchrun --nproc-per-node 4 examples/plain_transformer.py --schedule dualpipev --residual mhc:4 --steps 3
    mhcpipe check-split examples/plain_transformer.py:build --residual mhc:4
"""
from __future__ import annotations

from transformer_parts import CausalAttention, LMHead, PreNorm, SwiGLU, token_loss
from torch import nn

from mhcpipe.user import DeferLinear, UserModel, run

VOCAB, HIDDEN, HEADS, FFN, BLOCKS = 256, 64, 4, 128, 8


def build(residual: str = "residual:1", seq_len: int = 32) -> UserModel:
    """Its projections are DeferLinear (pipeline.weight_grad): under ZB1P and DualPipe their weight-gradients move
    from I to W, as the built-in model's do (with nn.Linear I computes them and W is empty)."""
    sublayers = []
    for _ in range(BLOCKS):
        sublayers += [PreNorm(HIDDEN, CausalAttention(HIDDEN, HEADS, DeferLinear), seq_len),
                      PreNorm(HIDDEN, SwiGLU(HIDDEN, FFN, DeferLinear), seq_len)]
    return UserModel.from_sublayers(embed=nn.Embedding(VOCAB, HIDDEN), sublayers=sublayers,
                                    head=LMHead(HIDDEN, VOCAB), loss=token_loss, hidden=HIDDEN, vocab_size=VOCAB,
                                    residual=residual, name="plain-transformer")


if __name__ == "__main__":
    run(build)
