"""B/W split (schedules.md §4): a Linear whose weight-grad can be deferred into a FIFO store.

Shape letters: T tokens, K input features, N output features.

`DeferLinear` computes y = x W^T with a custom autograd function. Its backward always returns the input-grad
dx = dy W. The weight-grad dW = dy^T x is returned at once (B, full backward) unless the module's store is
*enabled* (I, input-grad only); then a closure that computes and accumulates dW is appended to the store's
current group. `flush(label)` closes the group under the (stage, mb) of the backward that filled it, and
`pop()` (one W action) runs the oldest group: W order equals the order of the split backwards, as in DeepSeek's
`WeightGradStore`. Parameters that are not in a DeferLinear (norms, embeddings, mHC phi/alpha/bias) receive
their gradients during I; only the Linears' GEMMs move to W, which is where the weight-grad FLOPs are.

The store is owned by one rank's runtime and handed to the modules at construction (no module-level state).
The flag is a plain attribute, not thread-local: on CUDA autograd runs backward in a device thread, but
`torch.autograd.backward` returns only after it has finished, so the caller's setting is what it sees.
"""
from __future__ import annotations

import collections
import math
from typing import Callable

import torch
from torch import nn


class WeightGradStore:
    """FIFO of deferred weight-grad groups, one group per split backward (I) action."""

    def __init__(self) -> None:
        self.enabled = False
        self._current: list[Callable[[], None]] = []
        self._queue: collections.deque[tuple[object, list[Callable[[], None]]]] = collections.deque()

    def put(self, fn: Callable[[], None]) -> None:
        self._current.append(fn)

    def flush(self, label: object) -> None:
        """Close the current group under `label` (the (stage, mb) of the I that produced it)."""
        self._queue.append((label, self._current))
        self._current = []

    def take_one(self):
        """One closure of the current (unflushed) group, removed from it, or None: filler work for a rank that
        would otherwise block (pipeline.runtime.overlap)."""
        return self._current.pop(0) if self._current else None

    def run_current(self) -> None:
        """Run the current (unflushed) group now: a full B's weight-grads, deferred past its input-grad send."""
        fns, self._current = self._current, []
        for fn in fns:
            fn()

    def peek_label(self) -> object | None:
        return self._queue[0][0] if self._queue else None

    def pop(self) -> object:
        """Run the oldest group (one W action); returns its label."""
        if not self._queue:
            raise RuntimeError("W action with an empty weight-grad queue: the schedule runs a W before its I")
        label, fns = self._queue.popleft()
        for fn in fns:
            fn()
        return label

    def __len__(self) -> int:
        return len(self._queue)

    def clear(self) -> None:
        self._current = []
        self._queue.clear()


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype`; the tensor itself when it already is (a no-op `.to` still costs microseconds of dispatch,
    and the layers call it several times per token batch)."""
    return t if t.dtype == dtype else t.to(dtype)


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, module: "DeferLinear") -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.module = module
        return x @ as_dtype(weight, x.dtype).t()

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        dx = dy @ as_dtype(weight, dy.dtype)
        store = ctx.module.store
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])  # [T, K], [T, N]
        if store is not None and store.enabled:
            w = ctx.module.weight  # the Parameter itself (a saved tensor may come back as another handle)

            def weight_grad() -> None:
                _accumulate(w, as_dtype(dy2.t() @ x2, w.dtype))

            store.put(weight_grad)
            return dx, None, None
        return dx, as_dtype(dy2.t() @ x2, weight.dtype), None


class DeferLinear(nn.Module):
    """Bias-free Linear [.., K] -> [.., N] with a deferrable weight-grad (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, store: WeightGradStore | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.reset_parameters()
        self.store = store

    def reset_parameters(self) -> None:
        """nn.Linear's default init (also what a model built on the meta device is initialised with)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LinearFn.apply(x, self.weight, self)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias=False"


def attach_store(module: nn.Module, store: WeightGradStore | None) -> None:
    """Point every DeferLinear under `module` at `store` (None = never defer)."""
    for m in module.modules():
        if isinstance(m, DeferLinear):
            m.store = store
