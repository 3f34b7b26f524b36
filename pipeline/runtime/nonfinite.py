"""Bad numbers: a step whose loss or gradients are not finite never reaches the optimizer.

After the gradient reductions and before the optimizer, each rank checks its loss contribution (head stages) and
the squared norm of every local stage's gradients, and the ranks exchange one small row each (an all-gather over
the world, through the device layer on NCCL like every collective of the step), so that every rank takes the same
decision: stop the run with one line naming the step, the first rank and its stage (as Megatron stops on a NaN
loss or gradient norm), or, with train.skip_nonfinite (--skip-nonfinite), skip the update (no optimizer step: the
parameters and AdamW's state stay those of the previous step) and count it in the log. A reduction sums a NaN
into every replica's copy, so the first rank by number is named, with what it saw itself.

Test hook: MHCPIPE_TEST_NAN_GRAD="<rank>:<step>" puts a NaN into one gradient of that rank after that step's
reductions.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from pipeline.distributed.collective import collective, group_device
from pipeline.distributed.errors import PipelineError

NAN_ENV = "MHCPIPE_TEST_NAN_GRAD"


class NonFiniteError(PipelineError):
    """A step's loss or gradients are not finite (every rank raises the same line)."""

    hang_related = False


def inject(rank: int, step: int, params) -> None:
    """The test hook (module docstring)."""
    spec = os.environ.get(NAN_ENV, "")
    if spec and spec.split(":") == [str(rank), str(step)]:
        for p in params:
            if p.grad is not None:
                p.grad.view(-1)[0] = float("nan")
                return


def local_row(loss_sum: torch.Tensor, stages: dict) -> torch.Tensor:
    """[loss not finite, gradients not finite, first stage with a non-finite gradient or -1] of this rank."""
    loss_bad = ~torch.isfinite(loss_sum.detach().float())
    first = torch.tensor(-1.0)
    grad_bad = torch.tensor(False)
    for s in sorted(stages):
        grads = [p.grad for p in stages[s].parameters() if p.grad is not None]
        if not grads:
            continue
        sq = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum()
        bad = ~torch.isfinite(sq).cpu()
        first = torch.where(bad & (first < 0), torch.tensor(float(s)), first)
        grad_bad = grad_bad | bad
    return torch.stack([loss_bad.cpu().float(), grad_bad.float(), first])


def verdict(rt, loss_sum: torch.Tensor, step: int) -> str | None:
    """One line when any rank's loss or gradients are not finite after step `step` (every rank gets the same
    answer), else None. Collective over the world group."""
    world = rt.groups.world_group
    mine = local_row(loss_sum, rt.stages)
    if world is None:
        rows = [mine.tolist()]
    else:
        where = group_device(world, rt.device)
        mine = mine.to(where)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(world))]
        collective(dist.all_gather, every, mine, what="the non-finite check's all-gather", rank=rt.rank,
                   timeout_s=rt.comms.timeout_s, group=world, dev=rt.posting_dev)
        rows = torch.stack(every).tolist()  # one host read of W x 3 numbers
    for r, (loss_bad, grad_bad, stage) in enumerate(rows):
        if loss_bad or grad_bad:
            what = "loss" if loss_bad else "gradient"
            where = ""
            if stage >= 0:
                spec = next(sp for sp in rt.plan.stages if sp.stage == int(stage))
                b = spec.blocks
                where = f", stage {int(stage)} " + (f"(block {b.start})" if len(b) == 1 else
                                                    f"(blocks {b.start}-{b.stop - 1})")
            return f"step {step + 1}: non-finite {what} on rank {r}{where}"
    return None
