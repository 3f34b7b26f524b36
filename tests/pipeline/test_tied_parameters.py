"""A user model's tied parameter (output projection = token embedding, examples/tied_model.py) across pipeline
stages: every holding rank keeps a copy, the copies' gradients are summed over the holders
(pipeline.distributed.tied), so the copies stay bitwise equal over steps and across a resume on another layout,
and check-split agrees with the unsplit model; without the sum the copies part after one step."""
from __future__ import annotations

from pathlib import Path

import torch

from rank_pool import launch

from configs import load_config

ROOT = Path(__file__).resolve().parents[2]
TIED = f"{ROOT}/examples/tied_model.py:build"


def _cfg(pp: int, dp: int, steps: int) -> dict:
    data = load_config("tiny").model_dump()
    data["parallel"].update(schedule="1f1b", ranks=pp, data_parallel=dp)
    data["train"].update(steps=steps)
    return data


def train_tied(rank: int, world: int, cfg_dict: dict, ckpt: str, resume: bool, no_sum: bool = False) -> dict:
    """Train (or resume) the tied example, checkpointing every step; return this rank's copy of the tied
    parameter (if it holds one) and the step losses."""
    from configs import parse_config
    from pipeline.checkpoint import dcp
    from pipeline.launch.user_config import build_model, load_builder, user_config
    import pipeline.runtime.train as train_mod

    if no_sum:  # the mutation: each holder trains its own copy
        train_mod.join_tie_groups = lambda *args: []
    cfg = parse_config(cfg_dict)
    model = build_model(load_builder(TIED), cfg.train.seed, None, cfg.parallel.seq_len)
    cfg = user_config(cfg, model)
    cpu = torch.device("cpu")
    rt = train_mod.RankRuntime(cfg, rank, cpu, groups=train_mod.make_groups(cfg, rank, world, cpu), record=False,
                               model=model)
    if resume:
        rt.start_step = dcp.load(Path(ckpt), rt)
    losses = []
    for k in range(rt.start_step, cfg.train.steps):
        losses.append(rt.step(k).loss)
        dcp.save(Path(ckpt), rt, k)
    p = rt.params.get("embed.weight")
    rt.close()
    return {"copy": None if p is None else p.detach().clone(), "losses": losses,
            "names": sorted(n for n in rt.params if "head.lm.out" in n)}


def _copies(results) -> list[torch.Tensor]:
    assert all(r.exitcode == 0 for r in results), [r.error for r in results]
    return [r.value["copy"] for r in results if r.value["copy"] is not None]


def test_tied_copies_stay_bitwise_equal_over_steps_and_after_a_resume_on_another_layout(tmp_path):
    first = launch(train_tied, 2, (_cfg(2, 1, 3), str(tmp_path), False), timeout_s=240)
    copies = _copies(first)
    assert len(copies) == 2  # pp2: the embedding on rank 0, the projection (the same parameter) on rank 1
    assert all(r.value["names"] == [] for r in first)  # it goes by embed.weight on the head's rank too
    assert torch.equal(copies[0], copies[1])
    start = _untrained()
    assert not torch.equal(copies[0], start)  # trained: equal because summed, not because untouched
    resumed = launch(train_tied, 4, (_cfg(2, 2, 5), str(tmp_path), True), timeout_s=240)
    after = _copies(resumed)
    assert len(after) == 4  # pp2 x dp2: two replicas of each end
    assert all(torch.equal(c, after[0]) for c in after)
    assert not torch.equal(after[0], copies[0])
    assert len(resumed[0].value["losses"]) == 2  # steps 3 and 4


def test_without_the_sum_over_the_holders_the_copies_part_after_one_step(tmp_path):
    got = _copies(launch(train_tied, 2, (_cfg(2, 1, 1), str(tmp_path), False, True), timeout_s=240))
    assert len(got) == 2 and not torch.equal(got[0], got[1])


def _untrained() -> torch.Tensor:
    from configs import parse_config
    from pipeline.launch.user_config import build_model, load_builder

    cfg = parse_config(_cfg(2, 1, 3))
    return build_model(load_builder(TIED), cfg.train.seed, None, cfg.parallel.seq_len).embed.weight.detach()
