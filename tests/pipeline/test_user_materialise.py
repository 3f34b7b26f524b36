"""A user model built on the meta device (pipeline.user_materialise): each rank materialises only its pieces, to
exactly the values the whole model materialised at once holds (check-split's reference), tied parameters
included; what no initialiser sets is refused in one line."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import plain_transformer

from pipeline.user_materialise import materialise, materialise_all, on_meta
from pipeline.user_model import ContractError, UserModel

CPU = torch.device("cpu")


def tied_meta() -> UserModel:
    m = plain_transformer.build_meta("mhc:4", 8, blocks=4)
    m.head.inner.out.weight = m.embed.weight
    return m


def test_every_split_of_the_pieces_materialises_the_values_of_the_whole_model():
    whole = tied_meta()
    assert on_meta(whole)
    materialise_all(whole, CPU, seed=3)
    assert not on_meta(whole)
    want = dict(whole.named_parts().named_parameters())
    assert all(not torch.isnan(p).any() for p in want.values())
    # a stage holding only the head (the tie's later holder) and stages in between
    for pieces in ({"head"}, {"blocks.1", "blocks.2"}, {"embed", "expand", "blocks.0"}, {"blocks.3", "head"}):
        part = tied_meta()
        materialise(part, pieces, CPU, seed=3)
        alias = {a: t.name for t in part.ties() for a in t.aliases}
        got = {alias.get(n, n): p for piece, m in part.pieces() if piece in pieces
               for n, p in m.named_parameters(prefix=piece)}
        assert got and set(got) <= set(want) and not any(p.is_meta for p in got.values())
        for name, p in got.items():
            assert torch.equal(p, want[name]), (pieces, name)
    # the tie is the embedding's initial value (its first holder's), not the projection's own init
    assert torch.equal(want["embed.weight"], whole.head.inner.out.weight)
    assert whole.head.inner.out.weight is whole.embed.weight
    assert not torch.equal(want["blocks.0.0.phi"], want["blocks.1.0.phi"])  # each piece its own seed
    other = tied_meta()
    materialise_all(other, CPU, seed=4)
    assert not torch.equal(other.embed.weight, whole.embed.weight)  # the run's seed decides


def test_a_parameter_no_initialiser_sets_is_refused_in_one_line():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(8))  # set in __init__ only: on meta it has no values

        def forward(self, x):
            return x * self.gain

    class Head(nn.Linear):
        def forward(self, x):
            return super().forward(x[:, 0])

    with torch.device("meta"):
        m = UserModel(embed=nn.Embedding(16, 8), blocks=[Scale()], head=Head(8, 16),
                      loss=nn.functional.cross_entropy, n=1, hidden=8, vocab_size=16)
    m.dry_run(4)  # shapes on meta: no memory, no numbers
    with pytest.raises(ContractError, match=r"^parameter blocks\.0\.gain: built on the meta device, and no "
                                            r"initialiser of its piece set it; give its module reset_parameters"):
        materialise_all(m, CPU, seed=0)
