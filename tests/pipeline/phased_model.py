"""A user model for the tests whose blocks expose phases that hand a tuple on (a state, an integer routing index
and a plain value), so an F&B pair interleaves at them and the runtime carries gradients through tuple states. The
streams mix through a learned n x n matrix, so they differ from the first block on (a check that only holds while
the copies are equal would pass by luck)."""
from __future__ import annotations

import torch
from torch import nn

from pipeline.user_model import UserModel

VOCAB, C, N, BLOCKS, EXPERTS = 64, 16, 4, 8, 3


class RoutedBlock(nn.Module):
    def __init__(self, work: int = 1):
        super().__init__()
        self.work = work  # rounds of the experts: time without parameters (measured balance must see it)
        self.mix = nn.Parameter(torch.eye(N) + 0.1 * torch.randn(N, N))
        self.route = nn.Linear(C, EXPERTS)
        self.experts = nn.ModuleList(nn.Linear(C, C) for _ in range(EXPERTS))

    def phases(self):
        return [("dispatch", self.dispatch), ("experts", self.run_experts)]

    def dispatch(self, x):
        x = torch.einsum("ij,tjc->tic", self.mix, x)
        idx = self.route(x.mean(1)).argmax(-1)  # [T] integer: no gradient, passed on as it is
        return x, idx, EXPERTS

    def run_experts(self, state):
        x, idx, experts = state
        h = x.mean(1)
        out = torch.zeros_like(h)
        for _ in range(self.work):
            for e in range(experts):
                rows = (idx == e).nonzero().squeeze(1)
                out = out.index_add(0, rows, torch.tanh(self.experts[e](h.index_select(0, rows))))
        return x + out[:, None, :] / self.work

    def forward(self, x):
        return self.run_experts(self.dispatch(x))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = nn.Linear(C, VOCAB)

    def forward(self, x):
        return self.out(x.mean(1))


def build() -> UserModel:
    return UserModel(embed=nn.Embedding(VOCAB, C), blocks=[RoutedBlock() for _ in range(BLOCKS)], head=Head(),
                     loss=nn.functional.cross_entropy, n=N, hidden=C, vocab_size=VOCAB, name="phased-test")


def build_measured() -> UserModel:
    """Blocks 0 and 1 do 40 rounds of their experts (as many parameters as the others, many times the time: a
    block's fixed autograd overhead shrinks the ratio, and under a loaded host 12 rounds measured only ~3x); stages
    balanced by measured block times (rank 0 times them, every rank cuts there)."""
    model = build()
    model.blocks = [RoutedBlock(40) if b < 2 else RoutedBlock() for b in range(BLOCKS)]
    model.balance = "measured"
    return model
