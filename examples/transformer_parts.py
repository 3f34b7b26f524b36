"""Plain Transformer pieces the examples share: causal attention and a SwiGLU MLP on [B, S, C], token embedding,
a hash-routed MLP (experts chosen from the token id, as DeepSeek-V4's hash-routed layers do), nothing of mhc-pipe.

Shape letters: B sequences, S sequence length, T = B x S tokens, C hidden, H heads, V vocabulary.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def plain_linear(fan_in: int, fan_out: int) -> nn.Module:
    return nn.Linear(fan_in, fan_out, bias=False)


class CausalAttention(nn.Module):
    """[B, S, C] -> [B, S, C] (no norm: the residual wrapper or the caller norms). `linear`: how its projections
    are made (bias-free, (fan_in, fan_out) -> module), nn.Linear by default."""

    def __init__(self, hidden: int, heads: int, linear=plain_linear):
        super().__init__()
        self.heads = heads
        self.qkv = linear(hidden, 3 * hidden)
        self.out = linear(hidden, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, c = h.shape
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(b, s, c))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int, linear=plain_linear):
        super().__init__()
        self.w13 = linear(hidden, 2 * ffn)
        self.w2 = linear(ffn, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        a, g = self.w13(h).chunk(2, dim=-1)
        return self.w2(F.silu(a) * g)


class HashRoutedMLP(nn.Module):
    """Token t goes to expert ids[t] mod E: the routing needs the real token ids, on whichever stage it runs."""

    def __init__(self, hidden: int, ffn: int, experts: int):
        super().__init__()
        self.experts = nn.ModuleList(SwiGLU(hidden, ffn) for _ in range(experts))

    def forward(self, h: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        flat, ids = h.reshape(-1, h.shape[-1]), token_ids.reshape(-1) % len(self.experts)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = (ids == e).nonzero().squeeze(1)
            out = out.index_add(0, rows, expert(flat.index_select(0, rows)))
        return out.view_as(h)


class PreNorm(nn.Module):
    """RMSNorm then `core`, on [T, C] tokens that `core` sees as [B, S, C] (a sub-layer function for mhc-pipe's
    residual wrapper, which hands it [T, C])."""

    def __init__(self, hidden: int, core: nn.Module, seq_len: int):
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=1e-6)
        self.core = core
        self.seq_len = seq_len

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        t, c = h.shape
        return self.core(self.norm(h).view(t // self.seq_len, self.seq_len, c)).reshape(t, c)


class LMHead(nn.Module):
    """[T, C] -> logits [T, V]."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=1e-6)
        self.out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(h))


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy (statistics in at least fp32)."""
    return F.cross_entropy(logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits, labels)
