"""A user's model, in one process: the contract's one-line refusals, the partition, the builder's loading and
seeding, and the unsplit reference check-split compares against (pipeline.user_model, pipeline.launch.user_config,
pipeline.user_reference). The multi-rank checks are in test_check_split.py and test_user_model_cli.py."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeline.launch.user_config import build_model, load_builder, user_config, user_run
from pipeline.user_model import ContractError, UserModel, balanced_chunks

ROOT = Path(__file__).resolve().parents[2]
HC = f"{ROOT}/examples/hc_model.py"


class Lin(nn.Module):
    """A block that keeps the contract: x + a per-stream linear map."""

    def __init__(self, c: int):
        super().__init__()
        self.w = nn.Linear(c, c)

    def forward(self, x):
        return x + self.w(x)


def small(**over) -> UserModel:
    c, v = 8, 16
    parts = dict(embed=nn.Embedding(v, c), blocks=[Lin(c) for _ in range(4)], head=SumHead(c, v),
                 loss=nn.functional.cross_entropy, n=2, hidden=c, vocab_size=v)
    parts.update(over)
    return UserModel(**parts)


class SumHead(nn.Module):
    def __init__(self, c, v):
        super().__init__()
        self.out = nn.Linear(c, v)

    def forward(self, x):
        return self.out(x.sum(1))


class NoReduceHead(SumHead):
    def forward(self, x):
        return self.out(x)  # [T, n, V]: the stream reduction is missing


class ToHidden(nn.Module):
    def forward(self, x):
        return x.mean(1)  # [T, C]: one stream's worth, not [T, n, C]


def test_a_block_that_returns_one_stream_is_named_in_one_line():
    m = small(blocks=[Lin(8), ToHidden(), Lin(8)])
    with pytest.raises(ContractError) as err:
        m.dry_run(4)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("block 1 (ToHidden) returned shape [4, 8]; a block maps [T, n, C] -> [T, n, C] = [4, 2, 8]")


def test_a_head_without_the_stream_reduction_is_named():
    with pytest.raises(ContractError, match=r"head returned shape \[4, 2, 16\]; it must return logits \[T, V\] = "
                                            r"\[4, 16\] \(per-stream logits: the head must reduce the n streams\)"):
        small(head=NoReduceHead(8, 16)).dry_run(4)


def test_embedding_expand_and_loss_keep_their_shapes():
    with pytest.raises(ContractError, match=r"embed returned shape \[4, 1, 8\] for 4 token ids; it must return "
                                            r"\[T, C\] = \[4, 8\]"):
        small(embed=nn.Sequential(nn.Embedding(16, 8), nn.Unflatten(1, (1, 8)))).dry_run(4)
    with pytest.raises(ContractError, match=r"loss returned shape \[4\]; it must return a scalar"):
        small(loss=lambda logits, labels: nn.functional.cross_entropy(logits, labels, reduction="none")).dry_run(4)
    with pytest.raises(ContractError, match=r"UserModel.blocks\[1\] is a str"):
        small(blocks=[Lin(8), "attention"])
    with pytest.raises(ContractError, match=r"UserModel.n = 0"):
        small(n=0)


def test_balanced_chunks_minimise_the_largest_stage_and_fill_every_stage():
    assert balanced_chunks([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    assert balanced_chunks([5, 1, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 6)]
    assert balanced_chunks([1, 1, 1, 1, 1, 1, 1, 10], 4)[-1] == range(7, 8)
    # exhaustive on small cases: contiguous, every chunk non-empty, and no split has a smaller maximum
    import itertools
    for costs in itertools.product([1, 2, 7], repeat=5):
        for k in (1, 2, 3, 5):
            got = balanced_chunks(list(costs), k)
            assert len(got) == k and all(len(r) for r in got) and got[0].start == 0 and got[-1].stop == 5
            assert all(a.stop == b.start for a, b in zip(got, got[1:]))
            best = min(max(sum(costs[a:b]) for a, b in zip((0, *cut), (*cut, 5)))
                       for cut in itertools.combinations(range(1, 5), k - 1))
            assert max(sum(costs[r.start:r.stop]) for r in got) == best, (costs, k, got)


def test_split_points_are_the_users_or_refused_in_one_line():
    assert small(split_points=[1]).chunks(2) == [range(0, 1), range(1, 4)]
    with pytest.raises(ContractError, match=r"split_points \[3, 2\]: give 2 increasing block indices in 1..3"):
        small(split_points=[3, 2]).chunks(3)
    with pytest.raises(ContractError, match="4 blocks cannot fill 8 pipeline stages"):
        small().chunks(8)


def test_builders_load_from_a_file_or_a_module_and_refuse_in_one_line(tmp_path):
    assert callable(load_builder(f"{HC}:build"))
    assert callable(load_builder("examples.plain_transformer:build")) if (ROOT / "examples/__init__.py").exists() \
        else True
    for spec, want in ((f"{HC}", "give FILE.py:FUNCTION or MODULE:FUNCTION"),
                       (f"{tmp_path}/none.py:build", "does not exist"),
                       (f"{HC}:nothing", "has no function nothing")):
        with pytest.raises(ValueError, match=want):
            load_builder(spec)
    bad = tmp_path / "bad.py"
    bad.write_text("import not_a_module_anywhere\n")
    with pytest.raises(ValueError, match="importing .*bad.py failed: ModuleNotFoundError"):
        load_builder(f"{bad}:build")
    wrong = tmp_path / "wrong.py"
    wrong.write_text("def build():\n    return 42\n\ndef boom():\n    raise RuntimeError('no GPU here')\n")
    with pytest.raises(ValueError, match=r"build\(\) returned a int; it must return a pipeline.user_model.UserModel"):
        build_model(load_builder(f"{wrong}:build"), 0)
    with pytest.raises(ValueError, match=r"building the model \(boom\) failed: RuntimeError: no GPU here"):
        build_model(load_builder(f"{wrong}:boom"), 0)
    with pytest.raises(ValueError, match="takes no residual argument"):
        build_model(load_builder(f"{HC}:build"), 0, residual="mhc:4")


def test_every_rank_builds_the_same_parameters_whatever_its_rng():
    builder = load_builder(f"{HC}:build")
    a = build_model(builder, 3).named_parts().state_dict()
    torch.manual_seed(1234)
    torch.rand(7)
    b = build_model(builder, 3).named_parts().state_dict()
    c = build_model(builder, 4).named_parts().state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point() and a[k].numel() > 1)


def test_unsplit_reference_gradients_are_the_whole_batch_gradients():
    """The reference runs micro-batch by micro-batch: its loss and parameter gradients must equal one forward of
    the whole batch (float64), and its boundary gradients the autograd gradient of each block's output."""
    from configs import load_config
    from pipeline.data import make_batch
    from pipeline.launch.check_split import case_config
    from pipeline.user_reference import unsplit_run

    model = build_model(load_builder(f"{ROOT}/examples/plain_transformer.py:build"), 0, "mhc:4", seq_len=32)
    cfg = user_config(case_config(load_config("tiny"), "1f1b", 4, 1), model)
    ref = unsplit_run(model, cfg)
    parts = model.named_parts()
    batch = make_batch(cfg, 0)
    ids, labels = batch.inputs.reshape(-1), batch.labels.reshape(-1)
    x = model.embed_tokens(ids, torch.float64)
    for b in range(len(model.blocks)):
        x = model.blocks[b](x)
    loss = model.loss(model.head(x), labels)
    loss.backward()
    assert abs(float(loss.detach()) - ref.loss) <= 1e-12 * abs(float(loss.detach()))
    assert set(ref.grads) == {k for k, p in parts.named_parameters() if p.grad is not None}
    for k, p in parts.named_parameters():
        err = float((ref.grads[k] - p.grad).norm() / p.grad.norm().clamp_min(1e-300))
        assert err < 1e-12, (k, err)
    assert ref.state_grads[0, 7].abs().sum() > 0 and ref.states[0, -1].shape == (64, 4, 64)


def test_user_run_refuses_what_only_the_built_in_model_has(monkeypatch):
    from pipeline.launch.entry import add_run_arguments
    import argparse

    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    builder = load_builder(f"{HC}:build")
    for flags, want in ((["--diagnostics-every", "1"], "--diagnostics-every"),
                        (["--interleave", "residual:1"], "--interleave"),
                        (["--pp", "16"], "model.num_blocks=8 cannot fill 32 pipeline stages")):
        with pytest.raises(ValueError, match=want):
            user_run(builder, parser.parse_args(["--config", "tiny", *flags]), None)
    cfg, _ = user_run(builder, parser.parse_args(["--config", "tiny", "--pp", "2", "--recompute", "auto",
                                                  "--dtype", "bfloat16"]), None)
    assert cfg.recompute.mode == "auto" and cfg.train.dtype == "bfloat16"  # both run for a user model
    cfg, model = user_run(builder, parser.parse_args(["--config", "tiny", "--pp", "2"]), None)
    assert cfg.model.num_blocks == 8 and cfg.model.residual.n == 4 and cfg.model.name.endswith("(user model)")
    assert sys.modules.get("hyper_connections") is not None


class Phased(nn.Module):
    """A block in two phases; the first hands on a tuple (the state, an integer index and a plain value)."""

    def __init__(self, c: int, broken: str = ""):
        super().__init__()
        self.a, self.b = nn.Linear(c, c), nn.Linear(c, c)
        self.broken = broken

    def phases(self):
        if self.broken == "names":
            return [("first phase", self.one)]
        return [("route", self.one), ("apply", self.two)]

    def one(self, x):
        return x + self.a(x), x[..., 0].argmax(-1), "kept as it is"

    def two(self, state):
        x, idx, note = state
        y = x + self.b(x) * (idx % 2)[:, None, None]
        return y[:, 0] if self.broken == "shape" else (y * 2 if self.broken == "math" else y)

    def forward(self, x):
        return self.two(self.one(x)) if self.broken != "math" else self.two(self.one(x)) / 2


def test_phases_are_checked_against_the_blocks_forward_and_their_contract():
    small(blocks=[Lin(8), Phased(8)]).dry_run(4)  # a tuple between phases, an integer index, a plain value: fine
    with pytest.raises(ContractError, match=r"block 1 \(Phased\).phases\(\) must return a non-empty list of "
                                            r"\(name, function\) pairs"):
        small(blocks=[Lin(8), Phased(8, "names")]).dry_run(4)
    with pytest.raises(ContractError, match=r"block 1 \(Phased\): its phases chained do not compute its forward "
                                            r"\(relative difference 1.0e\+00\)"):
        small(blocks=[Lin(8), Phased(8, "math")]).dry_run(4)
    with pytest.raises(ContractError, match=r"returned shape \[4, 8\]"):
        small(blocks=[Lin(8), Phased(8, "shape")]).dry_run(4)


def test_weights_tied_across_pieces_are_found_and_go_by_their_first_holders_name_on_every_stage():
    """An output projection tied to the token embedding (GPT-2 style) sits on the first and the last stage: the tie
    is found when the model is built, and a stage holding only the head names the parameter `embed.weight`, as the
    unsplit model does (gradients, checkpoints and the sum over its holders go by that name); a tie inside one
    piece is the piece's own."""
    from pipeline.user_model import Parts, Tie

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import hc_model

    m = hc_model.build(8)
    assert m.ties() == []
    m.head.lm.out.weight = m.embed.weight
    assert m.ties() == [Tie("embed.weight", ("head.lm.out.weight",), ("embed", "head"))]
    last = dict(Parts(m, range(7, 8), embed=False, head=True).named_parameters())
    assert last["embed.weight"] is m.embed.weight and "head.lm.out.weight" not in last
    assert sum(n == "embed.weight" for n, _ in m.named_parts().named_parameters()) == 1
    inner = hc_model.build(8)
    inner.blocks[0].register_parameter("again", next(inner.blocks[0].parameters()))  # tied inside one block
    assert inner.ties() == []
