"""B/W split: deferred weight-grads equal immediate ones, run FIFO, and I leaves W's work undone."""
from __future__ import annotations

import pytest
import torch

from pipeline.weight_grad import DeferLinear, WeightGradStore


def _grads(defer: bool):
    torch.manual_seed(0)
    store = WeightGradStore()
    a, b = DeferLinear(8, 6, store), DeferLinear(6, 5, store)
    x = torch.randn(7, 8, requires_grad=True)
    dy = torch.randn(7, 5)
    store.enabled = defer
    b(torch.tanh(a(x))).backward(dy)
    store.enabled = False
    pending = a.weight.grad is None and b.weight.grad is None
    if defer:
        store.flush(("s0", 0))
        assert store.pop() == ("s0", 0)
    return x.grad, a.weight.grad, b.weight.grad, pending


def test_deferred_equals_immediate():
    dx0, ga0, gb0, _ = _grads(False)
    dx1, ga1, gb1, pending = _grads(True)
    assert pending, "an I must not produce weight-grads of deferred Linears"
    assert torch.equal(dx0, dx1) and torch.allclose(ga0, ga1, rtol=1e-6) and torch.allclose(gb0, gb1, rtol=1e-6)


def test_fifo_and_empty_pop():
    store = WeightGradStore()
    order = []
    for label in ("a", "b", "c"):
        store.put(lambda label=label: order.append(label))
        store.flush(label)
    assert [store.pop() for _ in range(3)] == ["a", "b", "c"] == order
    with pytest.raises(RuntimeError, match="empty weight-grad queue"):
        store.pop()
