"""Gradient reduction over the data-parallel copies (and DualPipe's mirrored copies), asynchronous, per stage.

A stage's gradients are final once the last action of the step that writes them has run: its last W, B, or the
B half of an F&B (read off the rank's action list). Right then its dense gradients are flattened into one buffer
and an all-reduce (sum) over the dense gradient group is posted, and its expert gradients over the expert group
(pipeline.distributed.layout); nothing waits for them until `finish()`, before the optimizer, so the reductions run
under the rest of the step (the pipeline's drain, the other stage's work). The loss is the sum over the global batch
divided by its token count, so the sum over the copies is the gradient. DualPipe's two copies of a chunk are
two more copies in the same all-reduce, which also leaves them bitwise identical. A user model's tied parameters
(pipeline.distributed.tied) are in no stage's bucket: their copies' sums go over their holders, after the rest.

Collectives on one group must be posted in the same order by every member. Replicas of a pipeline rank run the
same schedule; DualPipe's mirrored ranks r and P-1-r run mirror images, in which each chunk finishes at the same
place. `GradReducer` checks this from the schedule (every rank's action list is known to every rank) and, if the
orders differ, posts all buckets at the end of the step in chunk order instead.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from pipeline.distributed.comm import Comms, Handle


def last_grad_actions(actions, local_stages) -> dict[int, int]:
    """Index of the last action writing each local stage's gradients (W, I, B, or the B half of an FB)."""
    last: dict[int, int] = {}
    for i, a in enumerate(actions):
        kind = a.kind.value
        if kind in ("W", "I", "B"):
            last[a.stage] = i
        elif kind == "FB":
            last[a.b_stage] = i
    return {s: i for s, i in last.items() if s in local_stages}


class _Bucket:
    __slots__ = ("label", "params", "group", "group_name", "peers", "flat", "handle")

    def __init__(self, label: str, params: list, group, group_name: str):
        self.label, self.params, self.group, self.group_name = label, params, group, group_name
        self.peers = f"gradient group (ranks {', '.join(map(str, dist.get_process_group_ranks(group)))})"
        self.flat: torch.Tensor | None = None
        self.handle: Handle | None = None


class GradReducer:
    def __init__(self, plan, stages: dict, groups, comms: Comms, actions, ties=()):
        """`ties`: the tied parameters' holder sets (pipeline.distributed.tied.TieSet); this rank's groups for those
        it is in are `groups.tie_groups`."""
        self.comms = comms
        self.buckets: dict[int, list[_Bucket]] = {}
        self.chunk = {sp.stage: sp.chunk for sp in plan.stages}
        tied = {name for s in ties for name in s.names}
        held = {name: p for stage in stages.values() for name, p in stage.named_parameters()}
        self.tie_buckets = [_Bucket(f"RG/{s.label}", [held[name] for name in s.names], groups.tie_groups[s.label],
                                    groups.name_of(groups.tie_groups[s.label]))
                            for s in ties if s.label in groups.tie_groups]
        for s, stage in sorted(stages.items()):
            named = sorted((n, p) for n, p in stage.named_parameters() if n not in tied)
            dense = [p for n, p in named if ".experts." not in n]
            expert = [p for n, p in named if ".experts." in n]
            bs = []
            if dense and groups.dense_grad_size > 1:
                bs.append(_Bucket(f"RG/s{s}/dense", dense, groups.dense_grad_group,
                                  groups.name_of(groups.dense_grad_group)))
            if expert and groups.expert_grad_size > 1:
                bs.append(_Bucket(f"RG/s{s}/experts", expert, groups.expert_grad_group,
                                  groups.name_of(groups.expert_grad_group)))
            if bs:
                self.buckets[s] = bs
        self.after: dict[int, list[int]] = {}
        self.eager = False
        if not self.buckets:
            return
        last = last_grad_actions(actions, set(stages))
        if set(last) != set(stages):
            raise ValueError(f"rank {plan.rank}: stages {sorted(set(stages) - set(last))} have no backward in the "
                             "schedule; their gradients would never be reduced")
        self.eager = plan.mirror is None or self._same_order(plan)
        if self.eager:
            for s, i in last.items():
                self.after.setdefault(i, []).append(s)

    @staticmethod
    def _same_order(plan) -> bool:
        """Do this rank and its DualPipe mirror finish their chunks in the same order?"""
        chunk = {sp.stage: sp.chunk for sp in plan.stages}

        def order(rank: int) -> list[int]:
            acts = plan.schedule.actions[rank]
            local = {sp.stage for sp in plan.stages if sp.rank == rank}
            last = last_grad_actions(acts, local)
            return [chunk[s] for s in sorted(last, key=last.get)]

        return order(plan.rank) == order(plan.mirror)

    @property
    def active(self) -> bool:
        return bool(self.buckets or self.tie_buckets)

    def action_done(self, index: int) -> None:
        """Called after action `index` of the step: post the reductions of the stages it finished."""
        for s in self.after.get(index, ()):
            for b in self.buckets.get(s, ()):
                self._post(b)

    def _post(self, b: _Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params]
        b.flat = torch.cat([g.reshape(-1) for g in grads])
        b.handle = self.comms.post(dist.all_reduce, b.flat, group=b.group, group_name=b.group_name, name=b.label,
                                   kind="RG", stage=None, mb=None, peer=b.peers)

    def finish(self) -> None:
        """Post what is left (chunk order, then the tied parameters' sums), wait for every reduction, put the sums
        back as the gradients."""
        in_order = [b for s in sorted(self.buckets, key=self.chunk.get) for b in self.buckets[s]] + self.tie_buckets
        for b in in_order:
            if b.handle is None:
                self._post(b)
        for b in in_order:
            self.comms.wait(b.handle)
            off = 0
            for p in b.params:
                p.grad = b.flat[off:off + p.numel()].view_as(p)
                off += p.numel()
            b.flat, b.handle = None, None
