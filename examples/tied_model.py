"""The hyper-connections decoder of hc_model.py with its output projection tied to its token embedding (one
nn.Parameter, GPT-2 style): the embedding sits on a pipeline's first stage, the projection on its last. mhc-pipe
finds the tie when the model is built, keeps a copy on every rank that holds either piece, sums the copies'
gradients over those ranks each step (pipeline.distributed.tied) and names the parameter `embed.weight` on every
layout:

    torchrun --nproc-per-node 2 examples/tied_model.py --schedule 1f1b --steps 3
    mhcpipe check-split examples/tied_model.py:build
"""
from __future__ import annotations

from hc_model import build as build_untied

from mhcpipe.user import UserModel, run


def build(seq_len: int = 32) -> UserModel:
    model = build_untied(seq_len)
    model.head.lm.out.weight = model.embed.weight  # [V, C] both: the projection reads the embedding's rows
    model.name = "hyper-connections-mhc-tied"
    return model


if __name__ == "__main__":
    run(build)
