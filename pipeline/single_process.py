"""The single-process model and training step: what every pipeline schedule must reproduce.

Shape letters: M micro-batches, B sequences per micro-batch, S sequence length, n streams, C hidden.

It is deliberately a different code path from the runtime: the whole batch (M x B x S tokens) goes through
one forward, sub-layers run their module's `forward` (`Block.forward`), and there is no stage split, no P2P,
no B/W split and no recompute. Parameter names (`embed.*`, `blocks.<b>.*`, `head.*`) are the names the runtime
uses for its stage parameters, so gradients can be compared name by name.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the type of every `cfg` here; configs is imported where it is used
    from configs import RunConfig

import torch
from torch import nn

from pipeline.data import Batch, make_batch
from pipeline.model import activation_dtype, build_block, build_embedding, build_head, make_optimizer, param_dtype


class SingleProcessModel(nn.Module):
    def __init__(self, cfg: RunConfig):
        super().__init__()
        mc, seed = cfg.model, cfg.train.seed
        self.embed = build_embedding(mc, seed, activation_dtype(cfg.train.dtype))
        self.blocks = nn.ModuleDict({str(b): build_block(mc, cfg.parallel.seq_len, b, seed)
                                     for b in range(mc.num_blocks)})
        self.head = build_head(mc, seed)

    def loss(self, batch: Batch) -> torch.Tensor:
        """Mean token cross-entropy over every micro-batch of the step."""
        x = self.embed(batch.inputs.reshape(-1))  # [M*B*S, n, C]
        if self.embed.entry is None:
            for b in range(len(self.blocks)):
                x = self.blocks[str(b)](x)
            return self.head(x, batch.labels.reshape(-1), batch.num_tokens)
        a = self.embed.entry_coefficient(x.shape[0], x)  # mhc-sp: the carried input-mixing coefficient
        for b in range(len(self.blocks)):
            x, a = self.blocks[str(b)](x, a)
        return self.head(x, batch.labels.reshape(-1), batch.num_tokens, a)


def train_single_process(cfg: RunConfig, steps: int = 1, device: str | torch.device = "cpu"):
    """Train `steps` optimizer steps on one process. Returns (losses, grads of step 0 by name, final params)."""
    model = SingleProcessModel(cfg).to(device=device, dtype=param_dtype(cfg.train.dtype))
    opt = make_optimizer(model.parameters(), cfg.train)
    losses, first_grads = [], {}
    for step in range(steps):
        batch = make_batch(cfg, step)
        batch = Batch(batch.inputs.to(device), batch.labels.to(device))
        opt.zero_grad(set_to_none=True)
        loss = model.loss(batch)
        loss.backward()
        losses.append(float(loss.detach()))
        if step == 0:
            first_grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
        opt.step()
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    return losses, first_grads, params
