"""A state of several tensors as one boundary message (pipeline.runtime.boundary) and the contract a model with
extra_state keeps (pipeline.user_model.StatePart)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.runtime.boundary import BoundaryLayout
from pipeline.user_model import ContractError, StatePart, UserModel


def test_parts_of_different_dtypes_round_trip_bitwise_as_aligned_views():
    layout = BoundaryLayout.of([("streams", (4, 6), torch.bfloat16), ("deferred", (6,), torch.float32),
                                ("scale", (1,), torch.float64)], tokens=5)
    state = (torch.randn(5, 4, 6).bfloat16(), torch.randn(5, 6), torch.randn(5, 1, dtype=torch.float64))
    flat = layout.pack(state)
    assert flat.dtype == torch.uint8 and flat.numel() == layout.nbytes
    assert all(off % 16 == 0 for off in layout.offsets) and layout.offsets[1] >= 5 * 4 * 6 * 2
    back = layout.unpack(flat)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(back, state))
    assert back[1].data_ptr() == flat.data_ptr() + layout.offsets[1]  # a view, no copy
    zeros = layout.unpack(layout.pack((state[0], None, None)))  # a gradient that does not reach a part
    assert torch.equal(zeros[0], state[0]) and not zeros[1].any() and not zeros[2].any()
    with pytest.raises(ValueError, match=r"boundary part 'deferred': got \[5, 6\] torch.float64"):
        layout.pack((state[0], state[1].double(), state[2]))


class Carry(nn.Module):
    def __init__(self, broken: bool = False):
        super().__init__()
        self.lin, self.broken = nn.Linear(8, 8), broken

    def forward(self, state):
        x, d = state
        y = x + self.lin(x)
        return y if self.broken else (y, d + y.mean(1).float())


class Entry(nn.Module):
    def forward(self, h):
        return h[:, None].expand(-1, 2, -1).contiguous(), torch.zeros(h.shape)


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = nn.Linear(8, 16)

    def forward(self, state):
        x, d = state
        return self.out(x.mean(1) + d.to(x.dtype))


def model(broken: bool = False) -> UserModel:
    return UserModel(embed=nn.Embedding(16, 8), expand=Entry(), blocks=[Carry(), Carry(broken)], head=Head(),
                     loss=nn.functional.cross_entropy, n=2, hidden=8, vocab_size=16,
                     extra_state=[StatePart("deferred", (8,), torch.float32)])


def test_a_block_that_drops_the_extra_state_is_named_in_one_line():
    model().dry_run(4)
    with pytest.raises(ContractError, match=r"^block 1 \(Carry\) returned shape \[4, 2, 8\]; with "
                                            r"UserModel.extra_state it must return the tuple \(streams, deferred\)"):
        model(broken=True).dry_run(4)
